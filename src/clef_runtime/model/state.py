"""A backbone's state between calls: what a continuation needs, what the state cache stores.

A `BackboneState` is the backbone after some tokens of one sequence: attention K/V, Gated DeltaNet conv and
recurrent states, the final-norm hidden rows of its positions and the next M-RoPE position. The state cache
holds it in two parts: a `StateSegment` (what grows with the tokens: K/V and hidden rows of a run) and a
`StatePoint` (what does not: the DeltaNet states at one position); `BackboneState.assemble` puts them back
together. `Continuation` / `ContinuationResult` are one row of a batched continuation
(`clef_runtime.model.prefill`). States are immutable by convention: restoring copies them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

__all__ = [
    "BackboneState",
    "Continuation",
    "ContinuationResult",
    "StatePoint",
    "StateSegment",
    "UnsupportedCacheError",
]


def _as_id_tensor(input_ids: Sequence[int] | Tensor) -> Tensor:
    ids = (
        input_ids.detach().to("cpu")
        if isinstance(input_ids, Tensor)
        else torch.tensor(list(input_ids), dtype=torch.long)
    )
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"input_ids must be one sequence ([T] or [1, T]), got shape {tuple(ids.shape)}")
    if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise ValueError(f"input_ids must be integers, got {ids.dtype}")
    return ids.long()


def _next_position(first_position: int, planes: Tensor, count: int) -> int:
    """The M-RoPE position of the token after the first ``count`` of a row with ``planes`` [3, L]: one past
    the largest position so far (an image block advances it by max(H, W), not by its token count)."""
    return max(first_position, int(planes[:, :count].max()) + 1)


class UnsupportedCacheError(RuntimeError):
    """The model's cache holds a layer kind that `BackboneState` cannot snapshot or restore (not a plain
    attention layer nor a single-state linear-attention layer)."""


@dataclass(frozen=True, eq=False)
class _AttentionSnapshot:
    keys: Tensor  # [1, kv_heads, L, head_dim]
    values: Tensor


@dataclass(frozen=True, eq=False)
class _LinearSnapshot:
    conv: Tensor  # [1, conv_dim, kernel]: the last `kernel` inputs of the causal conv
    recurrent: Tensor  # [1, value_heads, key_dim, value_dim]: the gated delta rule state


def _cache_layer_classes() -> tuple[type[DynamicLayer], type[LinearAttentionLayer]]:
    from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

    return DynamicLayer, LinearAttentionLayer


def _capture_row(
    cache: Any, row: int, kv_range: tuple[int, int] | None = None, *, attention: bool = True
) -> tuple[_AttentionSnapshot | _LinearSnapshot | None, ...]:
    """Copies of one batch row of every cache layer, as they are now: attention K/V (positions ``kv_range``
    only when given; None per attention layer when ``attention`` is False) and DeltaNet conv + recurrent
    states. Raises `UnsupportedCacheError` for a layer of another kind."""
    attention_class, linear_class = _cache_layer_classes()
    layers: list[_AttentionSnapshot | _LinearSnapshot | None] = []
    begin, end = kv_range if kv_range is not None else (0, None)
    for number, layer in enumerate(cache.layers):
        # Exact types: a subclass could hold more state than we copy (refuse rather than copy half).
        # (keys and values are set together with is_initialized; the None checks narrow their types)
        if (
            type(layer) is attention_class
            and layer.is_initialized
            and layer.keys is not None
            and layer.values is not None
        ):
            layers.append(
                _AttentionSnapshot(
                    layer.keys[row : row + 1, :, begin:end].clone(),
                    layer.values[row : row + 1, :, begin:end].clone(),
                )
                if attention
                else None
            )
        elif (
            type(layer) is linear_class
            and layer.number_of_states == 1
            and not layer.record_past
            and layer.has_previous_state[0]
            and layer.conv_states[0] is not None
            and layer.recurrent_states[0] is not None
        ):
            layers.append(
                _LinearSnapshot(
                    layer.conv_states[0][row : row + 1].clone(),
                    layer.recurrent_states[0][row : row + 1].clone(),
                )
                if kv_range is None
                else None
            )
        else:
            raise UnsupportedCacheError(
                f"cache layer {number} ({type(layer).__name__}) cannot be snapshotted in this state"
            )
    return tuple(layers)


def _nbytes(tensors: Sequence[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True, eq=False)
class StateSegment:
    """The part of a state that grows with its tokens, for a run of ``length`` consecutive tokens: each
    attention layer's K/V of those positions (None for DeltaNet layers) and their final-norm hidden rows
    ([length, hidden] on the model's device, in its compute dtype). A prefix tree node owns one; a state is
    restored by concatenating the segments along its path (`BackboneState.assemble`)."""

    kv: tuple[_AttentionSnapshot | None, ...] = field(repr=False)
    hidden: Tensor = field(repr=False)

    @property
    def length(self) -> int:
        """Tokens covered."""
        return int(self.hidden.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes held by the segment's tensors."""
        tensors = [self.hidden]
        for layer in self.kv:
            if layer is not None:
                tensors += [layer.keys, layer.values]
        return _nbytes(tensors)

    def slice(self, begin: int, end: int) -> StateSegment:
        """Tokens ``begin .. end - 1`` of the segment, with their own copies (so that dropping the original
        frees its memory). Raises ValueError unless 0 <= begin < end <= length."""
        if not 0 <= begin < end <= self.length:
            raise ValueError(f"cannot slice {begin}..{end} out of a segment of {self.length} tokens")
        kv = tuple(
            None
            if layer is None
            else _AttentionSnapshot(
                layer.keys[:, :, begin:end].clone(), layer.values[:, :, begin:end].clone()
            )
            for layer in self.kv
        )
        return StateSegment(kv=kv, hidden=self.hidden[begin:end].clone())


@dataclass(frozen=True, eq=False)
class StatePoint:
    """The part of a state that does not grow, at one position: each DeltaNet layer's conv and recurrent
    states there (None for attention layers) and the M-RoPE position of the next token. A state can be
    resumed only where a point was taken."""

    linear: tuple[_LinearSnapshot | None, ...] = field(repr=False)
    next_position: int

    @property
    def nbytes(self) -> int:
        """Bytes held by the point's tensors."""
        return _nbytes(
            [t for layer in self.linear if layer is not None for t in (layer.conv, layer.recurrent)]
        )


@dataclass(frozen=True, eq=False)
class BackboneState:
    """The backbone after ``length`` tokens of one sequence: enough to continue it, and its hidden rows.

    ``hidden``: [length, hidden] final-norm rows of those positions, on the model's device in its compute
    dtype (the head reads every row).
    ``next_position``: the M-RoPE position the next text token gets (after an image block this is not
    ``length``). Never modify a state: `Backbone.extend` copies it into a fresh cache.
    """

    layers: tuple[_AttentionSnapshot | _LinearSnapshot, ...] = field(repr=False)
    hidden: Tensor = field(repr=False)
    length: int
    next_position: int

    @property
    def nbytes(self) -> int:
        """Bytes held by the state's tensors (cache layers and hidden rows)."""
        tensors = [self.hidden]
        for layer in self.layers:
            if isinstance(layer, _AttentionSnapshot):
                tensors += [layer.keys, layer.values]
            else:
                tensors += [layer.conv, layer.recurrent]
        return _nbytes(tensors)

    def assemble(self, segments: Sequence[StateSegment], point: StatePoint) -> BackboneState:
        """The state after this one continued by ``segments`` (consecutive, in order) and resumed at
        ``point`` (taken right after the last segment): K/V and hidden rows concatenated (one copy), the
        DeltaNet states and next position from ``point``. This state is untouched. Raises
        `UnsupportedCacheError` when the parts do not have this state's layer layout."""
        kv_parts: list[list[_AttentionSnapshot]] = [[] for _ in self.layers]
        for segment in segments:
            if len(segment.kv) != len(self.layers):
                raise UnsupportedCacheError("a segment does not have the state's layer layout")
            for number, layer in enumerate(segment.kv):
                if layer is not None:
                    kv_parts[number].append(layer)
        if len(point.linear) != len(self.layers):
            raise UnsupportedCacheError("a point does not have the state's layer layout")
        layers: list[_AttentionSnapshot | _LinearSnapshot] = []
        for number, (own, linear) in enumerate(zip(self.layers, point.linear, strict=True)):
            if isinstance(own, _AttentionSnapshot) and linear is None:
                parts = [own, *kv_parts[number]]
                layers.append(
                    _AttentionSnapshot(
                        torch.cat([p.keys for p in parts], dim=2), torch.cat([p.values for p in parts], dim=2)
                    )
                )
            elif isinstance(own, _LinearSnapshot) and linear is not None and not kv_parts[number]:
                layers.append(linear)
            else:
                raise UnsupportedCacheError(f"layer {number}: the parts do not match the state's layout")
        added = sum(segment.length for segment in segments)
        return BackboneState(
            layers=tuple(layers),
            hidden=torch.cat([self.hidden, *(segment.hidden for segment in segments)]),
            length=self.length + added,
            next_position=point.next_position,
        )

    def to_cache(self, config: Any, batch: int) -> Any:
        """A fresh ``DynamicCache`` holding this state ``batch`` times (copies; this state is untouched).

        Raises `UnsupportedCacheError` when ``config`` builds a cache of another layout.
        """
        from transformers.cache_utils import DynamicCache

        attention_class, linear_class = _cache_layer_classes()
        cache = DynamicCache(config=config)
        if len(cache.layers) != len(self.layers):
            raise UnsupportedCacheError(
                f"the config builds {len(cache.layers)} cache layers, the state holds {len(self.layers)}"
            )
        for number, (layer, snapshot) in enumerate(zip(cache.layers, self.layers, strict=True)):
            if isinstance(snapshot, _AttentionSnapshot) and type(layer) is attention_class:
                # update() concatenates onto an empty tensor: the cache gets its own copy.
                layer.update(
                    snapshot.keys.expand(batch, -1, -1, -1), snapshot.values.expand(batch, -1, -1, -1)
                )
            elif isinstance(snapshot, _LinearSnapshot) and type(layer) is linear_class:
                # Both updates copy into freshly allocated buffers that the forward then updates in place.
                layer.update_conv_state(snapshot.conv.expand(batch, -1, -1).contiguous())
                layer.update_recurrent_state(snapshot.recurrent.expand(batch, -1, -1, -1).contiguous())
            else:
                raise UnsupportedCacheError(
                    f"cache layer {number} is a {type(layer).__name__}; the state holds "
                    f"{type(snapshot).__name__.strip('_')}"
                )
        return cache


@dataclass(frozen=True, eq=False)
class Continuation:
    """One row of `Backbone.extend`: the tokens that follow the start state.

    ``positions``: [3, L] M-RoPE planes of these tokens (default: the start's ``next_position`` + arange on
    every plane). ``image_rows``: ``(offset, rows)`` pairs; ``rows`` [n, hidden] replace the token embeddings
    at ``offset .. offset + n - 1`` (the ``<|image_pad|>`` block of an image). ``snapshot_at``: take a
    `BackboneState` after this many tokens of the row (1..L). ``points``: take a `StatePoint` after each of
    these many tokens (increasing, 1..L) and return the `StateSegment` of the row's tokens up to the last
    one: what a prefix tree stores.
    """

    input_ids: Sequence[int] | Tensor
    positions: Tensor | None = None
    image_rows: Sequence[tuple[int, Tensor]] = ()
    snapshot_at: int | None = None
    points: tuple[int, ...] = ()


@dataclass(frozen=True, eq=False)
class ContinuationResult:
    """What `Backbone.extend` returns per row: ``hidden`` [L, hidden] rows of the row's tokens (on the model's
    device, in its compute dtype) and,
    when asked for, ``snapshot`` (the state after ``snapshot_at`` tokens, counted from position 0),
    ``points`` (one `StatePoint` per asked point, in order) and ``segment`` (K/V and hidden rows of the
    row's tokens up to its last point)."""

    hidden: Tensor
    snapshot: BackboneState | None = None
    points: tuple[StatePoint, ...] = ()
    segment: StateSegment | None = None
