"""A batched prefill that can be advanced a few tokens at a time: the machinery behind `Backbone.extend`
and behind the engine's steps (`clef_runtime.engine.executor`).

A `BatchPrefill` holds rows that all continue one `BackboneState` (or start from nothing) in one batched
hybrid cache (attention K/V plus Gated DeltaNet conv and recurrent states). `BatchPrefill.advance` runs the
next ``tokens`` positions of every row still in the batch, in model calls split at every snapshot point,
every ``prefill_chunk`` boundary and every `call_width` boundary; a row whose last token was computed is
complete: its hidden rows, its snapshot, its points and its segment are collected and the row leaves the
batch (its cache row is dropped) before the next advance. Rows are right-padded with ``<|endoftext|>``
inside an advance (causal mixers: pads never reach real rows), so rows of one batch may end at different
places; `BatchPrefill.drop` removes rows that are no longer wanted (a cancelled request).

Every token of a row is computed exactly once, and a chunk boundary only changes where the cache carries
the sequence: the rows equal one pass over the whole row within float rounding.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from clef_runtime.model.kernels import flush_denormals
from clef_runtime.model.state import (
    BackboneState,
    Continuation,
    ContinuationResult,
    StatePoint,
    StateSegment,
    _as_id_tensor,
    _capture_row,
    _next_position,
)

__all__ = ["DEFAULT_MAX_CALL_TOKENS", "BatchPrefill", "PrefillModel", "call_width"]

#: Default cap on rows x tokens of one batched model call in `Backbone.extend` (see `call_width`). Measured on
#: the medium benchmark models (one thread, CPU time per token and row): 16 rows x 1,152 tokens in one call
#: cost 1.34x a row alone, because every per-layer activation and Gated DeltaNet intermediate of 18k tokens
#: leaves the CPU caches; the same batch in 256-token calls (4,096 tokens each) cost 0.90x a row alone.
DEFAULT_MAX_CALL_TOKENS = 4096

#: Call widths are multiples of the Gated DeltaNet chunk (64 tokens): a call of another length pads its last
#: chunk inside the kernel.
_CALL_WIDTH_QUANTUM = 64


def call_width(rows: int, max_call_tokens: int | None) -> int | None:
    """Tokens per model call for a batch of ``rows`` rows under a ``max_call_tokens`` budget of rows x tokens:
    the largest multiple of 64 that keeps ``rows * width`` within the budget, at least 64 (``None``: no
    budget, one call). Raises ValueError for a budget below 1 or fewer than one row."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    if max_call_tokens is None:
        return None
    if max_call_tokens < 1:
        raise ValueError(f"max_call_tokens must be >= 1, got {max_call_tokens}")
    width = max_call_tokens // rows // _CALL_WIDTH_QUANTUM * _CALL_WIDTH_QUANTUM
    return max(_CALL_WIDTH_QUANTUM, width)


class PrefillModel(Protocol):
    """What a prefill needs of the backbone (`clef_runtime.model.backbone.Backbone` has it)."""

    calls: int
    _pad_id: int

    @property
    def config(self) -> Any: ...

    @property
    def hidden_size(self) -> int: ...

    def _embed(self, ids: Tensor) -> Tensor: ...

    def _forward(self, embeds: Tensor, planes: Tensor, start: int, cache: Any | None) -> Tensor: ...


class BatchPrefill:
    """Rows that continue ``start`` (None: from nothing), advanced together (see the module docstring).

    Raises ValueError at construction for an empty batch, an empty row, planes or image rows that do not
    fit their row, a ``snapshot_at`` outside 1..L, points that are not increasing within 1..L, or a
    non-positive chunk; `UnsupportedCacheError` for a cache layout that cannot be snapshotted.
    """

    def __init__(
        self,
        backbone: PrefillModel,
        start: BackboneState | None,
        rows: Sequence[Continuation],
        *,
        prefill_chunk: int | None = None,
        max_call_tokens: int | None = None,
    ) -> None:
        if not rows:
            raise ValueError("rows is empty")
        if prefill_chunk is not None and prefill_chunk <= 0:
            raise ValueError(f"prefill_chunk must be positive, got {prefill_chunk}")
        self._backbone = backbone
        self._start = start
        self._rows = list(rows)
        self._prefill_chunk = prefill_chunk
        self._max_call_tokens = max_call_tokens
        self.offset = 0 if start is None else start.length
        """Where the rows begin in their sequence (the start state's length)."""
        self._first_position = 0 if start is None else start.next_position
        sequences = [_as_id_tensor(row.input_ids) for row in rows]
        self.lengths = [int(ids.shape[0]) for ids in sequences]
        """Tokens of every row (after the start)."""
        if min(self.lengths) == 0:
            raise ValueError(f"a row is empty (lengths {self.lengths})")
        longest, batch = max(self.lengths), len(rows)
        self._ids = torch.full((batch, longest), backbone._pad_id, dtype=torch.long)
        self._planes = torch.empty((3, batch, longest), dtype=torch.long)
        for number, (row, ids, length) in enumerate(zip(rows, sequences, self.lengths, strict=True)):
            self._ids[number, :length] = ids
            if row.positions is None:
                first = self._first_position
                own = torch.arange(first, first + length, dtype=torch.long).expand(3, -1)
            else:
                own = row.positions.detach().to("cpu").long()
                if tuple(own.shape) != (3, length):
                    raise ValueError(
                        f"row {number}: positions must be [3, {length}], got {tuple(row.positions.shape)}"
                    )
            self._planes[:, number, :length] = own
            if length < longest:
                self._planes[:, number, length:] = own[:, -1:] + torch.arange(1, longest - length + 1)
            if row.snapshot_at is not None and not 1 <= row.snapshot_at <= length:
                raise ValueError(f"row {number}: snapshot_at {row.snapshot_at} is outside 1..{length}")
            if row.points and (
                list(row.points) != sorted(set(row.points))
                or not 1 <= row.points[0] <= row.points[-1] <= length
            ):
                raise ValueError(f"row {number}: points {row.points} are not increasing within 1..{length}")
            for offset, image in row.image_rows:
                count = int(image.shape[0])
                if image.dim() != 2 or image.shape[1] != backbone.hidden_size or offset < 0:
                    raise ValueError(self._image_misfit(number, image, offset, length))
                if offset + count > length:
                    raise ValueError(self._image_misfit(number, image, offset, length))
        self.done = 0
        """Tokens of every row computed so far (the same for every row still in the batch)."""
        self._alive = list(range(batch))  # cache row -> row number
        self._hidden: dict[int, list[Tensor]] = {number: [] for number in range(batch)}
        self._snapshots: dict[int, tuple[Any, ...]] = {}
        self._linear_at: dict[tuple[int, int], tuple[Any, ...]] = {}
        self._results: dict[int, ContinuationResult] = {}
        self._cache = self._new_cache(batch)

    def _image_misfit(self, number: int, image: Tensor, offset: int, length: int) -> str:
        return (
            f"row {number}: image rows {tuple(image.shape)} at {offset} do not fit a row of {length} tokens "
            f"and width {self._backbone.hidden_size}"
        )

    def _new_cache(self, batch: int) -> Any:
        if self._start is None:
            from transformers.cache_utils import DynamicCache

            return DynamicCache(config=self._backbone.config)
        return self._start.to_cache(self._backbone.config, batch)

    # ----------------------------------------------------------------------------------------- queries

    @property
    def alive(self) -> tuple[int, ...]:
        """Row numbers still in the batch (not complete, not dropped), in row order."""
        return tuple(self._alive)

    def remaining(self, number: int) -> int:
        """Tokens row ``number`` still has to compute (0 once complete)."""
        return max(0, self.lengths[number] - self.done) if number in self._alive else 0

    @property
    def finished(self) -> bool:
        """No row left in the batch."""
        return not self._alive

    def result(self, number: int) -> ContinuationResult:
        """What row ``number`` computed (once complete). Raises KeyError before."""
        return self._results[number]

    # ---------------------------------------------------------------------------------------- stepping

    def _cuts(self, begin: int, end: int) -> list[int]:
        """The call boundaries in ``(begin, end]`` for the rows still in the batch."""
        cuts = {end}
        for number in self._alive:
            row = self._rows[number]
            if row.snapshot_at is not None and begin < row.snapshot_at < end:
                cuts.add(row.snapshot_at)
            cuts.update(p for p in row.points if begin < p < end)
        chunk = self._prefill_chunk
        if chunk is not None:
            cuts.update(range((begin // chunk + 1) * chunk, end, chunk))
        width = call_width(len(self._alive), self._max_call_tokens)
        if width is not None:
            cuts.update(range(begin + width, end, width))
        return sorted(cuts)

    def _embeds(self, begin: int, end: int) -> Tensor:
        """[B_alive, end - begin, hidden] input embeddings of positions ``begin .. end - 1``, image rows
        merged in."""
        backbone = self._backbone
        index = torch.tensor(self._alive, dtype=torch.long)
        embeds = backbone._embed(self._ids[index, begin:end])
        for slot, number in enumerate(self._alive):
            for offset, image in self._rows[number].image_rows:
                first, last = max(begin, offset), min(end, offset + int(image.shape[0]))
                if first < last:
                    embeds[slot, first - begin : last - begin] = image[first - offset : last - offset].to(
                        device=embeds.device, dtype=embeds.dtype
                    )
        return embeds

    def advance(self, tokens: int | None = None) -> list[int]:
        """Compute the next ``tokens`` positions of every row in the batch (None: to the end of the longest
        row), capped at the longest row's end. Returns the row numbers that completed, in row order (they
        have left the batch; `result` has what they computed). Raises ValueError for ``tokens < 1``."""
        if tokens is not None and tokens < 1:
            raise ValueError(f"tokens must be >= 1, got {tokens}")
        if not self._alive:
            return []
        longest = max(self.lengths[number] for number in self._alive)
        begin = self.done
        end = longest if tokens is None else min(longest, begin + tokens)
        index = torch.tensor(self._alive, dtype=torch.long)
        backbone = self._backbone
        with flush_denormals(), torch.inference_mode():
            for cut in self._cuts(begin, end):
                planes = self._planes[:, index, begin:cut]
                out = backbone._forward(self._embeds(begin, cut), planes, self.offset + begin, self._cache)
                backbone.calls += 1
                # The rows stay where and as the model made them (fp32 or bf16, CPU or GPU): the head
                # reads them on the model's device and upcasts to fp32 as it gathers; a copy to the host
                # and back would cost a GPU a round trip per step.
                for slot, number in enumerate(self._alive):
                    if begin < self.lengths[number]:
                        self._hidden[number].append(out[slot, : self.lengths[number] - begin])
                    row = self._rows[number]
                    if row.snapshot_at == cut:
                        self._snapshots[number] = _capture_row(self._cache, slot)
                    if cut in row.points:
                        self._linear_at[number, cut] = _capture_row(self._cache, slot, attention=False)
                begin = cut
            self.done = end
            complete = [number for number in self._alive if self.lengths[number] <= end]
            for number in complete:
                self._results[number] = self._collect(number, self._alive.index(number))
        if complete:
            self._keep([number for number in self._alive if number not in complete])
        return complete

    def drop(self, numbers: Iterable[int]) -> None:
        """Take rows out of the batch without completing them (nothing of theirs is kept)."""
        gone = set(numbers)
        for number in gone:
            self._hidden.pop(number, None)
        self._keep([number for number in self._alive if number not in gone])

    def _keep(self, numbers: list[int]) -> None:
        """Keep only ``numbers`` (a subsequence of the alive rows) in the cache."""
        if numbers == self._alive:
            return
        if numbers:
            slots = torch.tensor([self._alive.index(number) for number in numbers], dtype=torch.long)
            for layer in self._cache.layers:
                layer.reorder_cache(slots)
        else:
            self._cache = None
        self._alive = numbers

    def _collect(self, number: int, slot: int) -> ContinuationResult:
        """The result of row ``number`` (cache row ``slot``), which has just computed its last token."""
        row, length, start = self._rows[number], self.lengths[number], self._start
        own_hidden = torch.cat(self._hidden.pop(number))[:length]
        planes = self._planes[:, number]
        first = self._first_position
        snapshot = None
        if row.snapshot_at is not None:
            cut = row.snapshot_at
            state_hidden = own_hidden[:cut] if start is None else torch.cat([start.hidden, own_hidden[:cut]])
            snapshot = BackboneState(
                layers=self._snapshots.pop(number),
                hidden=state_hidden.clone(),
                length=self.offset + cut,
                next_position=_next_position(first, planes, cut),
            )
        points = tuple(
            StatePoint(
                linear=self._linear_at.pop((number, at)),
                next_position=_next_position(first, planes, at),
            )
            for at in row.points
        )
        segment = None
        if row.points:
            # Attention K/V never change once written: the segment is read once, when the row completes.
            kv = _capture_row(self._cache, slot, (self.offset, self.offset + row.points[-1]))
            segment = StateSegment(kv=kv, hidden=own_hidden[: row.points[-1]].clone())  # type: ignore[arg-type]
        return ContinuationResult(hidden=own_hidden, snapshot=snapshot, points=points, segment=segment)
