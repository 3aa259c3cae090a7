"""The Qwen3.5 backbone of a Clef release: transformers' text model, loaded from the release's shards.

Only the text stack (``Qwen3_5TextModel``: embeddings, 24 Gated DeltaNet + 8 attention layers, final norm) is
built. ``lm_head.weight`` is never instantiated and the 248,320-wide logits are never computed: the head reads
``lm_head`` rows through `clef_runtime.model.lexical.LexicalTable`. The vision tower is not loaded for
text use.

Loading: the module tree is built on the meta device (no allocation, no random init), then every text tensor
is read from the safetensors shards one at a time, cast to the compute dtype and assigned. Peak memory is the
final model plus one tensor; there is never an fp32 copy of everything next to a bf16 copy. No
``from_pretrained``, no ``trust_remote_code``, no pickle.

Prefill: `Backbone.hidden_states` returns the final-norm ``last_hidden_state`` of every position, either in
one pass or in fixed-size chunks that carry a ``DynamicCache`` (attention KV + DeltaNet conv and recurrent
states), including the seed's form (64-token calls, the last one padded with ``<|endoftext|>``).

Continuation: `Backbone.extend` runs a right-padded batch of rows that all continue one `BackboneState` (or
start from nothing), with per-row M-RoPE planes and image rows merged into the embeddings, and can snapshot
each row at its own offset (the call is split there, so the snapshot is exactly the state after that many
tokens). A `BackboneState` holds everything a later continuation needs: attention K/V, DeltaNet conv and
recurrent states, the final-norm hidden rows of its positions and the next M-RoPE position. It is
immutable by convention: restoring copies it, so a cached state is never modified by the run that uses it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from clef_runtime.encoding.special_tokens import ENDOFTEXT_ID
from clef_runtime.model import memory
from clef_runtime.model.checkpoint import CheckpointError, CheckpointInfo, verify_checkpoint
from clef_runtime.model.device import resolve_device, resolve_dtype
from clef_runtime.model.fused import quiet_fallback_advice
from clef_runtime.model.kernels import configure_cpu_threads, flush_denormals, install_cpu_kernels
from clef_runtime.model.quantize import Int8Plan
from clef_runtime.model.weights import WeightPlan, apply_bf16_storage, plan_weights
from clef_runtime.release import CONFIG_FILE, INDEX_FILE, LM_HEAD_TENSOR, TEXT_PREFIX, VISION_PREFIX
from clef_runtime.shards import ShardError, read_shard, shard_path

__all__ = [
    "ENDOFTEXT_ID",
    "TRANSFORMERS_CONSTRUCTION_LOCK",
    "Backbone",
    "BackboneState",
    "Continuation",
    "ContinuationResult",
    "StatePoint",
    "StateSegment",
    "UnsupportedCacheError",
    "call_width",
    "resolve_device",
    "resolve_dtype",
]

logger = logging.getLogger(__name__)

#: Hold this while constructing any transformers model. Their constructors switch process-wide torch state
#: (the default dtype, to the config's ``dtype``) and restore it on exit; two constructions interleaved in
#: different threads can leave it switched for good (measured: two concurrent Qwen3.5 constructions left
#: torch's default dtype at bf16, silently changing later fp32 code).
TRANSFORMERS_CONSTRUCTION_LOCK = threading.RLock()

#: Default cap on rows x tokens of one batched model call in `Backbone.extend` (see `call_width`). Measured on
#: the medium benchmark models (one thread, CPU time per token and row): 16 rows x 1,152 tokens in one call
#: cost 1.34x a row alone, because every per-layer activation and Gated DeltaNet intermediate of 18k tokens
#: leaves the CPU caches; the same batch in 256-token calls (4,096 tokens each) cost 0.90x a row alone.
DEFAULT_MAX_CALL_TOKENS = 4096

#: Call widths are multiples of the Gated DeltaNet chunk (64 tokens): a call of another length pads its last
#: chunk inside the kernel.
_CALL_WIDTH_QUANTUM = 64

# Tensors in the shards that the text backbone deliberately does not load: lm_head is read row-wise by the
# lexical table, the vision tower only when images are used, MTP weights (absent in Clef-flash) never.
_SKIPPED_PREFIXES = (VISION_PREFIX, "mtp.")


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


def _cache_layer_classes() -> tuple[type, type]:
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
        if type(layer) is attention_class and layer.is_initialized:
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
    (fp32 CPU [length, hidden]). A prefix tree node owns one; a state is restored by concatenating the
    segments along its path (`BackboneState.assemble`)."""

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

    ``hidden``: fp32 CPU [length, hidden] final-norm rows of those positions (the head reads every row).
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
    """What `Backbone.extend` returns per row: ``hidden`` fp32 CPU [L, hidden] rows of the row's tokens and,
    when asked for, ``snapshot`` (the state after ``snapshot_at`` tokens, counted from position 0),
    ``points`` (one `StatePoint` per asked point, in order) and ``segment`` (K/V and hidden rows of the
    row's tokens up to its last point)."""

    hidden: Tensor
    snapshot: BackboneState | None = None
    points: tuple[StatePoint, ...] = ()
    segment: StateSegment | None = None


# ------------------------------------------------------------------------------------------ loading steps


def _device_and_dtype(
    device: str | torch.device, dtype: torch.dtype | str | None, threads: int | None, fused_kernels: bool
) -> tuple[torch.device, torch.dtype]:
    """Resolve the device and compute dtype, set torch's thread count for it and, off CPU, choose the
    DeltaNet kernels (`clef_runtime.model.fused`, process-wide; on CPU transformers' advice to install them
    is dropped). Returns both."""
    resolved_device = resolve_device(device)
    resolved_dtype = resolve_dtype(resolved_device, dtype)
    quiet_fallback_advice(resolved_device.type)
    if resolved_device.type == "cpu":
        configure_cpu_threads(threads)
    else:
        from clef_runtime.model.fused import fused_kernels_status, set_fused_kernels

        set_fused_kernels(fused_kernels)
        logger.info("fused DeltaNet kernels on %s: %s", resolved_device, fused_kernels_status())
        if threads is not None:
            torch.set_num_threads(threads)
    return resolved_device, resolved_dtype


def _apply_weight_mode(model: Any, plan: WeightPlan) -> None:
    """Put the loaded model's weights in their storage mode (the one place bf16 storage changes modules;
    int8 layers were made as the weights were read, by `Int8Plan`)."""
    if plan.bf16_storage:
        apply_bf16_storage(model)


def _meta_model(info: CheckpointInfo) -> tuple[Any, Any]:
    """Transformers' ``Qwen3_5TextModel`` of the release's text config, built on the meta device (no
    allocation, no random init). Returns (model, text config). Raises CheckpointError for a bad config."""
    # Submodule imports (not transformers' lazy top-level names, whose first resolution is not
    # thread-safe): two threads loading models at once must not race on an import.
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel

    config_path = info.path / CONFIG_FILE
    try:
        text_config = Qwen3_5Config.from_dict(dict(info.config)).text_config
    except (TypeError, ValueError, KeyError) as error:
        raise CheckpointError(
            f"{config_path}: not a valid Qwen3.5 config ({error})", file=config_path
        ) from error
    text_config._attn_implementation = "sdpa"
    text_config.use_cache = False
    with TRANSFORMERS_CONSTRUCTION_LOCK, torch.device("meta"):
        model = Qwen3_5TextModel(text_config)
    return model, text_config


def _load_text_weights(model: Any, info: CheckpointInfo, convert: Callable[[str, Tensor], Tensor]) -> None:
    """Stream every text tensor from the shards into ``model`` (one tensor at a time: each read is turned
    into what the model holds by ``convert(name, tensor)``, a cast or an int8 quantisation, and dropped).
    Raises CheckpointError for a tensor that is missing, unexpected, misshapen or unreadable."""
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    state: dict[str, Tensor] = {}
    unexpected: list[str] = []

    def wanted(key: str) -> bool:
        if key.startswith(TEXT_PREFIX) and key[len(TEXT_PREFIX) :] in expected:
            return True
        if not (key == LM_HEAD_TENSOR or key.startswith(_SKIPPED_PREFIXES)):
            unexpected.append(key)
        return False

    for shard in info.shards:
        try:
            for key, stored in read_shard(shard_path(info.path, shard), wanted):
                name = key[len(TEXT_PREFIX) :]
                if tuple(stored.shape) != expected[name]:
                    raise CheckpointError(
                        f"{info.shard_path(shard)}: tensor {key!r} has shape {list(stored.shape)}, "
                        f"the config implies {list(expected[name])}",
                        file=info.shard_path(shard),
                    )
                state[name] = convert(name, stored)
                del stored
        except ShardError as error:
            raise CheckpointError(str(error), file=error.file) from error
    missing = sorted(set(expected) - set(state))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing text tensors: {[TEXT_PREFIX + name for name in missing[:8]]}")
        if unexpected:
            parts.append(f"unexpected tensors: {sorted(unexpected)[:8]}")
        index_path = info.path / INDEX_FILE
        raise CheckpointError(
            f"{index_path}: the shards do not match the config's text model: " + "; ".join(parts),
            file=index_path,
        )
    model.load_state_dict(state, strict=True, assign=True)


def _rebuild_buffers(model: Any, text_config: Any, device: torch.device, path: Path) -> None:
    """Non-persistent buffers are not in the shards and are still on meta: rebuild the rotary table on the
    target device, in fp32 (a bf16 inv_freq would round the RoPE angles). Raises CheckpointError if anything
    is left on meta."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    with TRANSFORMERS_CONSTRUCTION_LOCK, torch.device(device):
        model.rotary_emb = Qwen3_5TextRotaryEmbedding(config=text_config)
    leftovers = [
        name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta
    ]
    if leftovers:
        raise CheckpointError(f"tensors left uninitialised after loading: {leftovers[:8]}")


class Backbone:
    """Transformers' ``Qwen3_5TextModel`` with Clef's release weights, used for prefill only."""

    def __init__(
        self,
        model: Any,
        *,
        path: Path,
        info: CheckpointInfo | None = None,
        compute_dtype: torch.dtype | None = None,
        weight_mode: str | None = None,
    ) -> None:
        """Wrap an already loaded ``Qwen3_5TextModel`` (use `Backbone.load` to build one from a release)."""
        self._model = model.eval()
        self._path = path
        self._info = info
        self._pad_id = ENDOFTEXT_ID
        self._compute_dtype = compute_dtype or model.embed_tokens.weight.dtype
        self.weight_mode = weight_mode or str(self._compute_dtype).removeprefix("torch.")
        #: `extend`'s default cap on rows x tokens per model call (None: every batch in as few calls as its
        #: cuts allow).
        self.max_call_tokens: int | None = DEFAULT_MAX_CALL_TOKENS
        #: Model calls made by `extend` since load (tests count them to see a batch being split).
        self.calls = 0

    # ------------------------------------------------------------------ loading

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        device: str | torch.device = "auto",
        dtype: torch.dtype | str | None = None,
        info: CheckpointInfo | None = None,
        check_memory: bool = True,
        threads: int | None = None,
        weights: str = "auto",
        int8_layers: str = "late",
        cpu_kernels: bool = True,
        fused_kernels: bool = True,
    ) -> Backbone:
        """Load the text backbone of the release directory ``path``.

        ``device``: "auto" (cuda if available, else cpu), "cpu" or "cuda[:N]". ``dtype``: default fp32 on CPU,
        bf16 on CUDA. ``info``: a `CheckpointInfo` from `verify_checkpoint` (verified here when omitted).
        ``check_memory``: estimate the memory need from the shard headers first and refuse cleanly when it
        does not fit (`clef_runtime.model.memory.InsufficientMemoryError`) instead of being killed halfway.
        ``threads``: torch's intra-op thread count (default: what `configure_cpu_threads` set earlier in the
        process, else one per core the process may use).
        ``weights`` (CPU, fp32 compute only): ``"fp32"``, ``"bf16-storage"`` (linear weights kept in bf16,
        each matmul computed in fp32: half the memory) or ``"auto"`` (fp32 when it fits in the available
        memory with headroom, else bf16 storage, else int8 layers: see `plan_weights`) or ``"int8"`` (the
        decoder Linears of the ``int8_layers`` selection in int8: `clef_runtime.model.quantize`; refused with
        `OptionsError` off CPU). ``cpu_kernels``: use clef-runtime's vectorised Gated
        DeltaNet kernels on CPU (equal to transformers' within 1e-5, 2-3x faster). ``fused_kernels``: off CPU,
        use the fused DeltaNet kernels of the ``cuda`` extra where installed (`clef_runtime.model.fused`;
        process-wide).

        Returns the Backbone in eval mode. Raises CheckpointError when the directory is invalid or a text
        tensor is missing, unexpected or misshapen; InsufficientMemoryError; ValueError for a bad device or
        dtype.
        """
        resolved_device, resolved_dtype = _device_and_dtype(device, dtype, threads, fused_kernels)
        if info is None:
            info = verify_checkpoint(path)
        # bf16 storage and int8 apply to fp32 compute on CPU: the weights are read in bf16 and stay bf16,
        # int8 weights are quantised as they are read (no full-precision copy of their layers).
        plan = plan_weights(
            weights, info=info, device=resolved_device, dtype=resolved_dtype, int8_layers=int8_layers
        )
        if check_memory:
            memory.check_fits(
                memory.estimate_model_memory(
                    info, device=resolved_device, dtype=plan.storage_dtype, int8_layers=plan.int8_layers
                )
            )
        model, text_config = _meta_model(info)
        int8 = Int8Plan(plan.int8_layers)
        int8.prepare(model)
        _load_text_weights(
            model,
            info,
            lambda name, stored: int8.convert(name, stored, device=resolved_device, dtype=plan.storage_dtype),
        )
        int8.finish(model)
        _rebuild_buffers(model, text_config, resolved_device, info.path)
        model.requires_grad_(False)
        _apply_weight_mode(model, plan)
        kernels = install_cpu_kernels(model) if cpu_kernels and resolved_device.type == "cpu" else 0
        logger.info(
            "loaded backbone from %s: %d layers, hidden %d, %s compute (weights %s) on %s, %d layers with "
            "CPU kernels",
            info.path,
            text_config.num_hidden_layers,
            text_config.hidden_size,
            resolved_dtype,
            plan.label,
            resolved_device,
            kernels,
        )
        return cls(model, path=info.path, info=info, compute_dtype=resolved_dtype, weight_mode=plan.label)

    # --------------------------------------------------------------- properties

    @property
    def model(self) -> Any:
        """The wrapped transformers ``Qwen3_5TextModel``."""
        return self._model

    @property
    def config(self) -> Any:
        """The text config (``Qwen3_5TextConfig``)."""
        return self._model.config

    @property
    def hidden_size(self) -> int:
        """Width of the hidden rows (4096 for Clef-flash)."""
        return int(self._model.config.hidden_size)

    @property
    def device(self) -> torch.device:
        """Device the weights live on."""
        return self._model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype of the activations (with bf16 storage the weights are bf16, the compute fp32)."""
        return self._compute_dtype

    @property
    def num_parameters(self) -> int:
        """Number of parameters held (text model only: no lm_head, no vision tower)."""
        from clef_runtime.model.quantize import Int8Linear

        int8 = sum(m.weight.numel() for m in self._model.modules() if isinstance(m, Int8Linear))
        return int8 + sum(parameter.numel() for parameter in self._model.parameters())

    @property
    def path(self) -> Path:
        """The release directory the weights came from."""
        return self._path

    @property
    def info(self) -> CheckpointInfo | None:
        """The `CheckpointInfo` of the release directory, when loaded with `Backbone.load`."""
        return self._info

    # ------------------------------------------------------------------ prefill

    def _positions(self, length: int, position_ids: Tensor | None) -> Tensor:
        """[3, T] M-RoPE planes (t, h, w); text-only input uses arange on every plane."""
        if position_ids is None:
            return torch.arange(length, dtype=torch.long).expand(3, length)
        positions = position_ids.detach().to("cpu").long()
        if positions.dim() == 3 and positions.shape[1] == 1:
            positions = positions[:, 0]
        if positions.dim() == 1:
            positions = positions.expand(3, -1)
        if positions.dim() != 2 or positions.shape[0] != 3 or positions.shape[1] != length:
            raise ValueError(
                f"position_ids must be [T], [3, T] or [3, 1, T] with T = {length}, "
                f"got {tuple(position_ids.shape)}"
            )
        return positions

    def _forward(self, embeds: Tensor, planes: Tensor, start: int, cache: Any | None) -> Tensor:
        """One call of the text model on [B, S, hidden] embeddings at sequence offset ``start``; ``planes``
        are the M-RoPE planes, [3, S] (shared by the rows) or [3, B, S] (one set per row)."""
        batch, length = embeds.shape[0], embeds.shape[1]
        if planes.dim() == 2:
            planes = planes[:, None, :].expand(3, batch, length)
        # Row 0 is the plain sequence index (transformers uses it for the causal mask); rows 1..3 are the
        # M-RoPE planes. Passing them explicitly means no position state is ever inferred from earlier calls.
        sequence = torch.arange(start, start + length, dtype=torch.long).expand(1, batch, length)
        positions = torch.cat([sequence, planes], dim=0)
        output = self._model(
            inputs_embeds=embeds,
            position_ids=positions.to(self.device),
            cache=cache,
            use_cache=cache is not None,
        )
        return output.last_hidden_state

    def _embed(self, ids: Tensor) -> Tensor:
        return self._model.embed_tokens(ids.to(self.device))

    def _merge_image_rows(
        self, embeds: Tensor, image_rows: Sequence[tuple[int, Tensor]], length: int, where: str
    ) -> None:
        """Write each (offset, [n, hidden]) block of image rows over ``embeds`` [T, hidden], in place."""
        for offset, rows in image_rows:
            count = int(rows.shape[0])
            if rows.dim() != 2 or rows.shape[1] != self.hidden_size or offset < 0 or offset + count > length:
                raise ValueError(
                    f"{where}: image rows {tuple(rows.shape)} at {offset} do not fit a row of {length} "
                    f"tokens and width {self.hidden_size}"
                )
            embeds[offset : offset + count] = rows.to(device=self.device, dtype=embeds.dtype)

    def embeddings(
        self, input_ids: Sequence[int] | Tensor, *, image_rows: Sequence[tuple[int, Tensor]] = ()
    ) -> Tensor:
        """Input embeddings of one row, [T, hidden] on the model's device and dtype, with each ``(offset,
        rows)`` block of image rows (vision-tower output, [n, hidden]) written over the token embeddings at
        ``offset .. offset + n - 1``. Raises ValueError for a block that does not fit the row."""
        ids = _as_id_tensor(input_ids)
        with flush_denormals(), torch.inference_mode():
            embeds = self._embed(ids)
            self._merge_image_rows(embeds, image_rows, int(ids.shape[0]), "embeddings")
        return embeds

    def _run(
        self, embeds: Tensor, planes: Tensor, real_length: int, prefill_chunk: int | None, pad_last: bool
    ) -> Tensor:
        """Prefill [B, T, hidden] embeddings; returns [B, T, hidden] final-norm rows (T = real_length)."""
        if prefill_chunk is None or (prefill_chunk >= real_length and not pad_last):
            return self._forward(embeds, planes, 0, None)
        from transformers.cache_utils import DynamicCache

        if prefill_chunk <= 0:
            raise ValueError(f"prefill_chunk must be positive, got {prefill_chunk}")
        cache = DynamicCache(config=self._model.config)
        pieces = []
        for start in range(0, real_length, prefill_chunk):
            end = min(start + prefill_chunk, real_length)
            piece_embeds, piece_planes = embeds[:, start:end], planes[:, start:end]
            missing = prefill_chunk - (end - start)
            if pad_last and missing:
                # The seed's form: the last call is padded with <|endoftext|> to the full chunk width at the
                # following positions; causality keeps the pads from reaching the real rows, which are kept.
                pad = self._embed(torch.full((missing,), self._pad_id, dtype=torch.long))
                pad = pad.to(piece_embeds.dtype)[None].expand(embeds.shape[0], -1, -1)
                piece_embeds = torch.cat([piece_embeds, pad], dim=1)
                following = piece_planes[:, -1:] + torch.arange(1, missing + 1, dtype=torch.long)
                piece_planes = torch.cat([piece_planes, following], dim=1)
            pieces.append(self._forward(piece_embeds, piece_planes, start, cache)[:, : end - start])
        return torch.cat(pieces, dim=1)

    def hidden_states(
        self,
        input_ids: Sequence[int] | Tensor,
        *,
        prefill_chunk: int | None = None,
        pad_last_chunk: bool = False,
        position_ids: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
    ) -> Tensor:
        """Final-norm hidden rows of every position of one sequence: a [T, hidden] fp32 tensor on CPU.

        ``prefill_chunk=None`` runs one full pass; ``prefill_chunk=N`` runs ceil(T/N) calls carrying a
        ``DynamicCache`` (attention KV + DeltaNet conv and recurrent states). ``pad_last_chunk=True`` pads the
        last call with ``<|endoftext|>`` (248044) to N tokens and drops the padded rows (the seed's readout).
        ``position_ids``: optional M-RoPE positions, [T] or [3, T] (default arange on all three planes).
        ``inputs_embeds``: optional [T, hidden] embeddings that replace the token embeddings (e.g. with image
        rows merged in); ``input_ids`` then only fixes T.

        Every call starts from fresh state: nothing carries from one request to the next. Raises ValueError
        for empty input, shape mismatches or a non-positive chunk.
        """
        ids = _as_id_tensor(input_ids)
        length = int(ids.shape[0])
        if length == 0:
            raise ValueError("input_ids is empty")
        if pad_last_chunk and prefill_chunk is None:
            raise ValueError("pad_last_chunk needs a prefill_chunk")
        if prefill_chunk is not None and prefill_chunk <= 0:
            raise ValueError(f"prefill_chunk must be positive, got {prefill_chunk}")
        planes = self._positions(length, position_ids)
        with flush_denormals(), torch.inference_mode():
            if inputs_embeds is not None:
                embeds = inputs_embeds.detach()
                if embeds.dim() == 3 and embeds.shape[0] == 1:
                    embeds = embeds[0]
                if tuple(embeds.shape) != (length, self.hidden_size):
                    raise ValueError(
                        f"inputs_embeds must be [T, hidden] = [{length}, {self.hidden_size}], "
                        f"got {tuple(inputs_embeds.shape)}"
                    )
                embeds = embeds.to(device=self.device, dtype=self.dtype)
            else:
                embeds = self._embed(ids)
            rows = self._run(embeds[None], planes, length, prefill_chunk, pad_last_chunk)[0]
            return rows.to(device="cpu", dtype=torch.float32)

    def extend(
        self,
        start: BackboneState | None,
        rows: Sequence[Continuation],
        *,
        prefill_chunk: int | None = None,
        max_call_tokens: int | Literal["default"] | None = "default",
    ) -> list[ContinuationResult]:
        """Run ``rows`` as one right-padded batch that continues ``start`` (``None``: from nothing).

        Every row continues its own copy of ``start``. Rows are padded with ``<|endoftext|>`` at the end
        (causal mixers: pads cannot change real rows; their planes continue the row's last position). The
        batch runs in calls split at every multiple of ``prefill_chunk`` (``None``: no chunking), at every
        multiple of `call_width` (``rows x tokens`` of one call within ``max_call_tokens``; ``"default"``:
        the backbone's ``max_call_tokens``, ``None``: no cap), and at every row's ``snapshot_at``, so each
        snapshot is the exact state after its row's own prefix, whatever the other rows are doing. The
        cap keeps a call's working set in the CPU caches: a wide batch of long rows in one call is slower
        per token than the same rows one by one, in calls of a few thousand tokens it is faster.

        Returns one `ContinuationResult` per row, in order. Raises ValueError for an empty batch, an empty
        row, planes or image rows that do not fit the row, a ``snapshot_at`` outside 1..L, or a
        non-positive chunk; `UnsupportedCacheError` for a model whose cache layout cannot be snapshotted.
        """
        if not rows:
            raise ValueError("rows is empty")
        if prefill_chunk is not None and prefill_chunk <= 0:
            raise ValueError(f"prefill_chunk must be positive, got {prefill_chunk}")
        offset = 0 if start is None else start.length
        first_position = 0 if start is None else start.next_position
        sequences = [_as_id_tensor(row.input_ids) for row in rows]
        lengths = [int(ids.shape[0]) for ids in sequences]
        if min(lengths) == 0:
            raise ValueError(f"a row is empty (lengths {lengths})")
        longest, batch = max(lengths), len(rows)

        padded = torch.full((batch, longest), self._pad_id, dtype=torch.long)
        planes = torch.empty((3, batch, longest), dtype=torch.long)
        for number, (row, ids, length) in enumerate(zip(rows, sequences, lengths, strict=True)):
            padded[number, :length] = ids
            if row.positions is None:
                own = torch.arange(first_position, first_position + length, dtype=torch.long).expand(3, -1)
            else:
                own = row.positions.detach().to("cpu").long()
                if tuple(own.shape) != (3, length):
                    raise ValueError(
                        f"row {number}: positions must be [3, {length}], got {tuple(row.positions.shape)}"
                    )
            planes[:, number, :length] = own
            if length < longest:
                planes[:, number, length:] = own[:, -1:] + torch.arange(1, longest - length + 1)
            if row.snapshot_at is not None and not 1 <= row.snapshot_at <= length:
                raise ValueError(f"row {number}: snapshot_at {row.snapshot_at} is outside 1..{length}")
            if row.points and (
                list(row.points) != sorted(set(row.points))
                or not 1 <= row.points[0] <= row.points[-1] <= length
            ):
                raise ValueError(f"row {number}: points {row.points} are not increasing within 1..{length}")

        cuts = {longest} | {row.snapshot_at for row in rows if row.snapshot_at is not None}
        cuts |= {point for row in rows for point in row.points}
        if prefill_chunk is not None:
            cuts |= set(range(prefill_chunk, longest, prefill_chunk))
        width = call_width(batch, self.max_call_tokens if max_call_tokens == "default" else max_call_tokens)
        if width is not None:
            cuts |= set(range(width, longest, width))
        captured: dict[int, tuple[_AttentionSnapshot | _LinearSnapshot | None, ...]] = {}
        linear_at: dict[tuple[int, int], tuple[_AttentionSnapshot | _LinearSnapshot | None, ...]] = {}
        segments_kv: dict[int, tuple[_AttentionSnapshot | _LinearSnapshot | None, ...]] = {}
        with flush_denormals(), torch.inference_mode():
            embeds = self._embed(padded)
            for number, row in enumerate(rows):
                self._merge_image_rows(embeds[number], row.image_rows, lengths[number], f"row {number}")
            if start is None:
                from transformers.cache_utils import DynamicCache

                cache = DynamicCache(config=self._model.config)
            else:
                cache = start.to_cache(self._model.config, batch)
            pieces = []
            begin = 0
            for end in sorted(cuts):
                pieces.append(
                    self._forward(embeds[:, begin:end], planes[:, :, begin:end], offset + begin, cache)
                )
                self.calls += 1
                for number, row in enumerate(rows):
                    if row.snapshot_at == end:
                        captured[number] = _capture_row(cache, number)
                    if end in row.points:
                        linear_at[number, end] = _capture_row(cache, number, attention=False)
                begin = end
            for number, row in enumerate(rows):
                if row.points:
                    # Attention K/V never change once written: the segment is read once, after the last call.
                    segments_kv[number] = _capture_row(cache, number, (offset, offset + row.points[-1]))
            hidden = torch.cat(pieces, dim=1).to(device="cpu", dtype=torch.float32)

        results = []
        for number, (row, length) in enumerate(zip(rows, lengths, strict=True)):
            own_hidden = hidden[number, :length].clone()
            snapshot = None
            if row.snapshot_at is not None:
                cut = row.snapshot_at
                state_hidden = (
                    own_hidden[:cut] if start is None else torch.cat([start.hidden, own_hidden[:cut]])
                )
                snapshot = BackboneState(
                    layers=captured[number],  # type: ignore[arg-type]
                    hidden=state_hidden.clone(),
                    length=offset + cut,
                    next_position=_next_position(first_position, planes[:, number], cut),
                )
            points = tuple(
                StatePoint(
                    linear=linear_at[number, at],  # type: ignore[arg-type]
                    next_position=_next_position(first_position, planes[:, number], at),
                )
                for at in row.points
            )
            segment = (
                StateSegment(
                    kv=segments_kv[number],  # type: ignore[arg-type]
                    hidden=own_hidden[: row.points[-1]].clone(),
                )
                if row.points
                else None
            )
            results.append(
                ContinuationResult(hidden=own_hidden, snapshot=snapshot, points=points, segment=segment)
            )
        return results

    def initial_state(self, input_ids: Sequence[int] | Tensor) -> BackboneState:
        """The state after ``input_ids`` run from nothing at positions 0..T-1 (e.g. the constant prompt
        prefix). Raises ValueError for empty input."""
        length = int(_as_id_tensor(input_ids).shape[0])
        if length == 0:
            raise ValueError("input_ids is empty")
        result = self.extend(None, [Continuation(input_ids, snapshot_at=length)])[0]
        assert result.snapshot is not None
        return result.snapshot

    def __repr__(self) -> str:
        return (
            f"Backbone(path={str(self._path)!r}, layers={self.config.num_hidden_layers}, "
            f"hidden={self.hidden_size}, dtype={self.dtype}, device={self.device})"
        )
