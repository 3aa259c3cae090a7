"""The head `clef tune` writes is in the release layout: it loads strictly into `JointSchemaHead.from_files`
and into an independent module tree built here the way the reference names its modules (torch's own
`TransformerDecoderLayer`, `MultiheadAttention` and `Sequential`), so any loader of the release reads it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from clef_runtime.model.head import JointSchemaHead, read_head_config
from clef_runtime.release import HEAD_CONFIG_FILE, HEAD_WEIGHTS_FILE
from tests.tuning.conftest import CliRun


class _ReferenceEvidenceLayer(nn.Module):
    def __init__(self, width: int, heads: int, feedforward: int) -> None:
        super().__init__()
        self.query_norm = nn.LayerNorm(width)
        self.memory_norm = nn.LayerNorm(width)
        self.feedforward_norm = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.feedforward = nn.Sequential(
            nn.Linear(width, feedforward),
            nn.GELU(),
            nn.Dropout(0.0),
            nn.Linear(feedforward, width),
            nn.Dropout(0.0),
        )


class _ReferenceHead(nn.Module):
    """The release's module tree, written from docs/model.md section 6 without our head's code."""

    def __init__(
        self, hidden_size: int, width: int, routing_layers: int, layers: int, heads: int, feedforward: int
    ) -> None:
        super().__init__()
        self.hidden_norm = nn.LayerNorm(hidden_size)
        for name in ("memory", "question", "option_question", "global", "option_context", "option_lexical"):
            setattr(self, f"{name}_projection", nn.Linear(hidden_size, width, bias=False))
        self.type_embedding = nn.Embedding(3, width)
        self.evidence_layers = nn.ModuleList(
            _ReferenceEvidenceLayer(width, heads, feedforward) for _ in range(routing_layers)
        )
        self.option_summary_norm = nn.LayerNorm(width)
        self.layers = nn.ModuleList(
            nn.TransformerDecoderLayer(
                width, heads, feedforward, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
            )
            for _ in range(layers)
        )
        self.field_norm = nn.LayerNorm(width)
        self.option_norm = nn.LayerNorm(width)
        self.residual_scorer = nn.Sequential(
            nn.Linear(4 * width, width), nn.GELU(), nn.Dropout(0.0), nn.Linear(width, 1)
        )
        self.prior_logit_scale = nn.Parameter(torch.zeros(()))
        self.joint_logit_scale = nn.Parameter(torch.zeros(()))
        self.residual_gate = nn.Parameter(torch.zeros(()))


@pytest.mark.slow
def test_the_written_head_loads_strictly_everywhere(default_run: CliRun) -> None:
    assert default_run.status == 0, default_run.stderr
    config = read_head_config(default_run.out / HEAD_CONFIG_FILE)
    assert config == json.loads((default_run.out / HEAD_CONFIG_FILE).read_text(encoding="utf-8"))
    tensors = load_file(str(default_run.out / HEAD_WEIGHTS_FILE))
    ours = JointSchemaHead.from_files(default_run.out)
    reference = _ReferenceHead(**config)
    assert reference.load_state_dict(tensors, strict=True) is not None
    assert set(tensors) == set(ours.state_dict()) == set(reference.state_dict())
    for name, value in reference.state_dict().items():
        assert torch.equal(value, ours.state_dict()[name]), name
