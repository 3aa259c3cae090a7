"""Tests for LexicalTable: per-span means of lm_head rows, gathered without an fp32 copy of the table."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import save_file
from torch.overrides import TorchFunctionMode

from clef_runtime.model.lexical import LexicalTable, LexicalTableError

VOCAB, HIDDEN = 500, 24


def _bf16_table(seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(VOCAB, HIDDEN, generator=generator) * 0.05).to(torch.bfloat16)


def _naive_means(table: torch.Tensor, input_ids: list[int], spans: list[tuple[int, int]]) -> torch.Tensor:
    means = []
    for start, end in spans:
        rows = [table[token_id].float() for token_id in input_ids[start:end]]
        means.append(sum(rows) / len(rows))
    return torch.stack(means)


INPUT_IDS = [7, 12, 12, 499, 0, 7, 33, 12, 250, 250, 250, 3, 44, 7]
SPANS = [(0, 3), (3, 4), (4, 9), (8, 11), (11, 14), (2, 3)]


def test_option_means_equal_naive_span_means():
    table = _bf16_table()
    lexical = LexicalTable(table)
    means = lexical.option_means(INPUT_IDS, SPANS)
    assert means.dtype == torch.float32
    assert means.shape == (len(SPANS), HIDDEN)
    torch.testing.assert_close(means, _naive_means(table, INPUT_IDS, SPANS), rtol=0, atol=1e-7)
    # A tensor of ids gives the same answer.
    torch.testing.assert_close(lexical.option_means(torch.tensor(INPUT_IDS), SPANS), means, rtol=0, atol=0)


def test_table_is_kept_as_given():
    table = _bf16_table()
    lexical = LexicalTable(table)
    assert lexical.weight is table
    assert lexical.dtype == torch.bfloat16
    assert (lexical.vocab_size, lexical.hidden_size) == (VOCAB, HIDDEN)
    with pytest.raises(ValueError, match="2-D float"):
        LexicalTable(torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="2-D float"):
        LexicalTable(torch.zeros(4, 4, dtype=torch.int64))


class _TableAccessLog(TorchFunctionMode):
    """Records every torch function or tensor method that receives the table object itself."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = table
        self.calls: list[tuple[str, tuple, dict]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(value is self.table for value in (*args, *kwargs.values())):
            name = getattr(func, "__name__", repr(func))
            if name == "__get__":  # a property read such as .shape / .dtype / .device
                name = func.__self__.__name__
            self.calls.append((name, args, kwargs))
        return func(*args, **kwargs)


def test_only_the_unique_needed_rows_are_read_from_the_table():
    table = _bf16_table()
    lexical = LexicalTable(table)
    log = _TableAccessLog(table)
    with log:
        means = lexical.option_means(INPUT_IDS, SPANS)
    metadata = {"shape", "dtype", "device", "dim", "size", "is_floating_point"}
    reads = [(name, args, kwargs) for name, args, kwargs in log.calls if name not in metadata]
    # Exactly one read, an index_select of the sorted unique ids: no cast or copy of the whole table.
    assert [name for name, _, _ in reads] == ["index_select"]
    _, args, kwargs = reads[0]
    call = dict(zip(("input", "dim", "index"), args, strict=False)) | kwargs
    needed = sorted({token_id for start, end in SPANS for token_id in INPUT_IDS[start:end]})
    assert call["dim"] == 0
    assert call["index"].tolist() == needed
    assert means.shape == (len(SPANS), HIDDEN)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_table_dtypes(dtype):
    table = _bf16_table(1).to(dtype)
    means = LexicalTable(table).option_means(INPUT_IDS, SPANS)
    assert means.dtype == torch.float32
    torch.testing.assert_close(means, _naive_means(table, INPUT_IDS, SPANS), rtol=0, atol=1e-7)


def test_no_spans_and_output_device():
    lexical = LexicalTable(_bf16_table())
    empty = lexical.option_means(INPUT_IDS, [])
    assert empty.shape == (0, HIDDEN)
    assert empty.dtype == torch.float32
    assert lexical.option_means(INPUT_IDS, SPANS, device="cpu").device.type == "cpu"


@pytest.mark.parametrize(
    ("input_ids", "spans", "message"),
    [
        (INPUT_IDS, [(0, 2), (3, 3)], "option 1 span \\[3, 3\\)"),
        (INPUT_IDS, [(5, 15)], "outside the 14 input ids"),
        (INPUT_IDS, [(-1, 2)], "empty or outside"),
        ([1, 2, VOCAB], [(0, 3)], "outside \\[0, 500\\)"),
    ],
)
def test_invalid_spans_and_ids_are_rejected(input_ids, spans, message):
    with pytest.raises(ValueError, match=message):
        LexicalTable(_bf16_table()).option_means(input_ids, spans)


# --- loading from a sharded checkpoint -------------------------------------------------------------------


def _write_sharded(directory, table):
    """Two shards; the index puts lm_head.weight in the second. The first holds a decoy of the same name."""
    save_file(
        {
            "model.embed_tokens.weight": torch.zeros(VOCAB, HIDDEN, dtype=torch.bfloat16),
            "lm_head.weight": -table,
        },
        str(directory / "model-00001-of-00002.safetensors"),
    )
    save_file(
        {"lm_head.weight": table, "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16)},
        str(directory / "model-00002-of-00002.safetensors"),
    )
    index = {
        "metadata": {"total_size": 0},
        "weight_map": {
            "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
            "lm_head.weight": "model-00002-of-00002.safetensors",
            "model.norm.weight": "model-00002-of-00002.safetensors",
        },
    }
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("use_index_path", [False, True])
def test_from_safetensors_reads_the_shard_named_by_the_index(tmp_path, use_index_path):
    table = _bf16_table(2)
    _write_sharded(tmp_path, table)
    source = tmp_path / "model.safetensors.index.json" if use_index_path else tmp_path
    lexical = LexicalTable.from_safetensors(source)
    assert lexical.dtype == torch.bfloat16
    assert torch.equal(lexical.weight, table)
    norm = LexicalTable.from_safetensors(tmp_path, tensor_name="model.embed_tokens.weight")
    assert torch.equal(norm.weight, torch.zeros(VOCAB, HIDDEN, dtype=torch.bfloat16))


def test_from_safetensors_single_file_checkpoint(tmp_path):
    table = _bf16_table(3)
    save_file({"lm_head.weight": table}, str(tmp_path / "model.safetensors"))
    assert torch.equal(LexicalTable.from_safetensors(tmp_path).weight, table)
    assert torch.equal(LexicalTable.from_safetensors(tmp_path / "model.safetensors").weight, table)


def test_from_safetensors_errors(tmp_path):
    with pytest.raises(LexicalTableError, match="neither"):
        LexicalTable.from_safetensors(tmp_path)
    _write_sharded(tmp_path, _bf16_table())
    with pytest.raises(LexicalTableError, match=re.escape("no entry for 'lm_head.bias'")):
        LexicalTable.from_safetensors(tmp_path, tensor_name="lm_head.bias")
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(LexicalTableError, match=re.escape("model-00002-of-00002.safetensors")):
        LexicalTable.from_safetensors(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(LexicalTableError, match="weight_map"):
        LexicalTable.from_safetensors(tmp_path)
    with pytest.raises(LexicalTableError, match="index not found"):
        LexicalTable.from_safetensors(tmp_path / "missing.index.json")
    save_file({"other": torch.zeros(2, 2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(LexicalTableError, match=re.escape("no tensor named 'lm_head.weight'")):
        LexicalTable.from_safetensors(tmp_path)
