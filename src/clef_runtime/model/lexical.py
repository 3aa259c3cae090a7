"""The head's lexical input: the mean `lm_head.weight` row over each option span's token ids.

The release's table is 248,320 x 4,096 in bf16 (2 GB); an fp32 copy would be 4 GB. `LexicalTable` keeps
the table in its stored dtype and only ever reads it through one `index_select` of the unique ids a
request needs; those few rows are cast to fp32 and averaged.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from clef_runtime.release import LM_HEAD_TENSOR
from clef_runtime.shards import ShardError, open_index, read_tensors


class LexicalTableError(ValueError):
    """The lexical table cannot be found or read (names the file and tensor)."""


class LexicalTable:
    """A read-only [vocab, hidden] embedding table (normally `lm_head.weight`) kept in its own dtype."""

    def __init__(self, weight: Tensor) -> None:
        """Wraps `weight` as is (no copy, no cast). Raises ValueError unless it is a 2-D float tensor."""
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(
                f"LexicalTable: expected a 2-D float table, got {weight.dtype} {list(weight.shape)}"
            )
        self._weight = weight

    @property
    def weight(self) -> Tensor:
        """Returns the wrapped table (stored dtype and device)."""
        return self._weight

    @property
    def vocab_size(self) -> int:
        """Returns the number of rows (token ids)."""
        return int(self._weight.shape[0])

    @property
    def hidden_size(self) -> int:
        """Returns the row width."""
        return int(self._weight.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        """Returns the stored dtype of the table."""
        return self._weight.dtype

    @property
    def device(self) -> torch.device:
        """Returns the device the table lives on."""
        return self._weight.device

    @classmethod
    def from_safetensors(
        cls,
        index_json_path_or_dir: str | Path,
        tensor_name: str = LM_HEAD_TENSOR,
        *,
        device: str | torch.device | None = None,
    ) -> LexicalTable:
        """Loads one tensor of a (sharded) safetensors checkpoint, keeping its dtype.

        `index_json_path_or_dir` is a `model.safetensors.index.json`, a directory holding one (or, for an
        unsharded checkpoint, a `model.safetensors`), or a `.safetensors` file itself
        (`clef_runtime.shards.open_index`). Only `tensor_name` is read, from the shard the index names.
        `device` optionally moves the table (still in its dtype).
        Returns the table. Raises LexicalTableError if a file is missing or unreadable, the index lacks
        the tensor, or the shard does not hold it.
        """
        try:
            index = open_index(index_json_path_or_dir)
            shard_path = index.shard_of(tensor_name)
            ((_, weight),) = read_tensors(index, [tensor_name])
        except ShardError as error:
            raise LexicalTableError(str(error)) from error
        if device is not None:
            weight = weight.to(device)
        try:
            return cls(weight)
        except ValueError as error:
            raise LexicalTableError(f"{shard_path}: {tensor_name!r}: {error}") from error

    def option_means(
        self,
        input_ids: Sequence[int] | Tensor,
        option_spans: Sequence[tuple[int, int]],
        *,
        device: str | torch.device | None = None,
    ) -> Tensor:
        """Returns the [O, hidden] fp32 mean table row over each `[start, end)` span of `input_ids`.

        Only the unique ids inside the spans are gathered (one `index_select`) and cast to fp32. The result
        is on `device` (default: the table's device). Raises ValueError for an empty or out-of-range span
        or an id outside the vocabulary.
        """
        ids = torch.as_tensor(input_ids, dtype=torch.long, device="cpu").reshape(-1)
        target = torch.device(device) if device is not None else self._weight.device
        if len(option_spans) == 0:
            return torch.zeros(0, self.hidden_size, dtype=torch.float32, device=target)
        bounds = torch.as_tensor([tuple(span) for span in option_spans], dtype=torch.long).view(-1, 2)
        starts, ends = bounds[:, 0], bounds[:, 1]
        bad = (starts < 0) | (ends <= starts) | (ends > ids.shape[0])
        if bool(bad.any()):
            option = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"option_means: option {option} span [{int(starts[option])}, {int(ends[option])}) is empty "
                f"or outside the {ids.shape[0]} input ids"
            )
        lengths = ends - starts
        segments = torch.repeat_interleave(torch.arange(bounds.shape[0]), lengths)
        first_position = torch.cumsum(lengths, 0) - lengths
        positions = starts[segments] + torch.arange(segments.shape[0]) - first_position[segments]
        span_ids = ids[positions]
        if bool(((span_ids < 0) | (span_ids >= self.vocab_size)).any()):
            raise ValueError(
                f"option_means: a token id in the option spans is outside [0, {self.vocab_size})"
            )
        unique_ids, inverse = torch.unique(span_ids, sorted=True, return_inverse=True)
        rows = torch.index_select(self._weight, 0, unique_ids.to(self._weight.device))
        rows = rows.to(device=target, dtype=torch.float32)
        sums = torch.zeros(bounds.shape[0], self.hidden_size, dtype=torch.float32, device=target)
        sums.index_add_(0, segments.to(target), rows[inverse.to(target)])
        return sums / lengths.to(device=target, dtype=torch.float32)[:, None]
