"""The file layout of a Clef release: file names and tensor-name prefixes, defined once.

A leaf module (no torch, no package imports): the checkpoint verifier, the backbone, the head, the lexical
table, the vision tower and the tiny checkpoint writer all name the release's files through it. Layout of
``Cloudflare/clef-flash`` (see docs/model.md).
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "CONFIG_FILE",
    "HEAD_CONFIG_FILE",
    "HEAD_WEIGHTS_FILE",
    "INDEX_FILE",
    "LM_HEAD_TENSOR",
    "PROCESSOR_CONFIG_FILE",
    "SINGLE_WEIGHTS_FILE",
    "TEXT_PREFIX",
    "TOKENIZER_CONFIG_FILE",
    "TOKENIZER_FILE",
    "VISION_PREFIX",
]

CONFIG_FILE: Final = "config.json"
INDEX_FILE: Final = "model.safetensors.index.json"
"""The shard index (``weight_map``: tensor name -> shard file name) of a sharded checkpoint."""
SINGLE_WEIGHTS_FILE: Final = "model.safetensors"
"""The one weights file of an unsharded checkpoint (no index)."""
HEAD_WEIGHTS_FILE: Final = "joint_head.safetensors"
HEAD_CONFIG_FILE: Final = "joint_head_config.json"
TOKENIZER_FILE: Final = "tokenizer.json"
TOKENIZER_CONFIG_FILE: Final = "tokenizer_config.json"
PROCESSOR_CONFIG_FILE: Final = "processor_config.json"

TEXT_PREFIX: Final = "model.language_model."
"""Name prefix of the text backbone's tensors in a ``Qwen3_5ForConditionalGeneration`` checkpoint."""
VISION_PREFIX: Final = "model.visual."
"""Name prefix of the vision tower's tensors."""
LM_HEAD_TENSOR: Final = "lm_head.weight"
