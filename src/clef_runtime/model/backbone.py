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
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from clef_runtime.encoding.special_tokens import ENDOFTEXT_ID
from clef_runtime.model import memory
from clef_runtime.model.checkpoint import CheckpointError, CheckpointInfo, verify_checkpoint
from clef_runtime.model.compute_dtype import ComputeChoice, choose_compute_dtype, dtype_name
from clef_runtime.model.device import resolve_device, resolve_dtype
from clef_runtime.model.fp8 import Fp8Plan
from clef_runtime.model.fused import quiet_fallback_advice
from clef_runtime.model.kernels import configure_cpu_threads, flush_denormals, install_cpu_kernels
from clef_runtime.model.prefill import DEFAULT_MAX_CALL_TOKENS, BatchPrefill, call_width
from clef_runtime.model.quantize import Int8Plan, LinearQuantPlan
from clef_runtime.model.state import (
    BackboneState,
    Continuation,
    ContinuationResult,
    _as_id_tensor,
)
from clef_runtime.model.weights import WeightPlan, apply_bf16_storage, plan_weights
from clef_runtime.options import COMPUTE_DTYPES
from clef_runtime.release import CONFIG_FILE, INDEX_FILE, LM_HEAD_TENSOR, TEXT_PREFIX, VISION_PREFIX
from clef_runtime.shards import ShardError, read_shard, shard_path

__all__ = [
    "ENDOFTEXT_ID",
    "TRANSFORMERS_CONSTRUCTION_LOCK",
    "Backbone",
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

# Tensors in the shards that the text backbone deliberately does not load: lm_head is read row-wise by the
# lexical table, the vision tower only when images are used, MTP weights (absent in Clef-flash) never.
_SKIPPED_PREFIXES = (VISION_PREFIX, "mtp.")


# ------------------------------------------------------------------------------------------ loading steps


def _prepare_device(device: str | torch.device, threads: int | None, fused_kernels: bool) -> torch.device:
    """Resolve the device, set torch's thread count for it and, off CPU, choose the DeltaNet kernels
    (`clef_runtime.model.fused`, process-wide; on CPU transformers' advice to install them is dropped). Off
    CPU a missing fused kernel is logged once at WARNING (unless ``fused_kernels`` turned them off)."""
    resolved_device = resolve_device(device)
    quiet_fallback_advice(resolved_device.type)
    if resolved_device.type == "cpu":
        configure_cpu_threads(threads)
    else:
        from clef_runtime.model.fused import (
            fused_kernels_status,
            missing_fused_kernels_warning,
            set_fused_kernels,
        )

        set_fused_kernels(fused_kernels)
        status = fused_kernels_status()
        logger.info("fused DeltaNet kernels on %s: %s", resolved_device, status)
        # Said once, loudly: transformers' own fallback is silent but for a hint on its first call.
        warning = missing_fused_kernels_warning(status, str(resolved_device)) if fused_kernels else None
        if warning is not None:
            logger.warning(warning)
        if threads is not None:
            torch.set_num_threads(threads)
    return resolved_device


def _compute_choice(
    dtype: torch.dtype | str | None, device: torch.device, weights: str, info: CheckpointInfo
) -> ComputeChoice:
    """The compute dtype: the ``--dtype`` values (``auto``, ``fp32``, ``bf16``) are decided by
    `choose_compute_dtype` (device, CPU flags, a GEMM measured at the model's width, ``weights``); torch
    dtypes, other names and None (the device's default) by `resolve_dtype`."""
    if dtype in COMPUTE_DTYPES:
        text = info.text_config
        return choose_compute_dtype(
            str(dtype),
            device=device,
            weights=weights,
            hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text.get("intermediate_size", text["hidden_size"])),
        )
    resolved = resolve_dtype(device, dtype)
    default = "the device's default" if dtype is None else "asked for"
    return ComputeChoice(resolved, default)


def _apply_weight_mode(model: Any, plan: WeightPlan) -> None:
    """Put the loaded model's weights in their storage mode (the one place bf16 storage changes modules;
    int8 and fp8 layers were made as the weights were read, by `_quantization_plan`)."""
    if plan.bf16_storage:
        apply_bf16_storage(model)


def _quantization_plan(plan: WeightPlan) -> LinearQuantPlan:
    """The loading steps that quantise ``plan``'s layers as the shards are read (none when it has none)."""
    if plan.fp8_layers:
        return Fp8Plan(plan.fp8_layers)
    return Int8Plan(plan.int8_layers)


def _meta_model(info: CheckpointInfo) -> tuple[Any, Any]:
    """Transformers' ``Qwen3_5TextModel`` of the release's text config, built on the meta device (no
    allocation, no random init). Returns (model, text config). Raises CheckpointError for a bad config."""
    # Submodule imports (not transformers' lazy top-level names, whose first resolution is not
    # thread-safe): two threads loading models at once must not race on an import.
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config, Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextModel

    config_path = info.path / CONFIG_FILE
    try:
        text_config = Qwen3_5Config.from_dict(dict(info.config)).text_config
    except (TypeError, ValueError, KeyError) as error:
        raise CheckpointError(
            f"{config_path}: not a valid Qwen3.5 config ({error})", file=config_path
        ) from error
    # Qwen3_5Config always builds its text config (from a dict or defaults); the check narrows its type.
    if not isinstance(text_config, Qwen3_5TextConfig):
        raise CheckpointError(f"{config_path}: not a valid Qwen3.5 config (no text config)", file=config_path)
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
        dtype_reason: str = "",
    ) -> None:
        """Wrap an already loaded ``Qwen3_5TextModel`` (use `Backbone.load` to build one from a release)."""
        self._model = model.eval()
        self._path = path
        self._info = info
        self._pad_id = ENDOFTEXT_ID
        self._compute_dtype = compute_dtype or model.embed_tokens.weight.dtype
        self.weight_mode = weight_mode or dtype_name(self._compute_dtype)  # the options' words: bf16, fp32
        #: Why the compute dtype is what it is (``--dtype fp32``, ``auto: avx512_bf16, bf16 GEMM 3.4x ...``).
        self.dtype_reason = dtype_reason
        #: `extend`'s default cap on rows x tokens per model call (None: every batch in as few calls as its
        #: cuts allow). The cap keeps a CPU call's working set in the caches; a GPU wants the whole step in
        #: one call (its step budget already bounds it).
        self.max_call_tokens: int | None = DEFAULT_MAX_CALL_TOKENS if self.device.type == "cpu" else None
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

        ``device``: "auto" (cuda if available, else cpu), "cpu" or "cuda[:N]". ``dtype``: the compute dtype,
        a torch dtype or its name (``"fp32"``, ``"bf16"``, ...), ``"auto"`` (`choose_compute_dtype`: bf16 on
        CUDA and on CPUs with native bf16 that measure it faster at this model's width, else fp32) or None
        (fp32 on CPU, bf16 on CUDA). ``info``: a `CheckpointInfo` from `verify_checkpoint` (verified here
        when omitted).
        ``check_memory``: estimate the memory need from the shard headers first and refuse cleanly when it
        does not fit (`clef_runtime.model.memory.InsufficientMemoryError`) instead of being killed halfway.
        ``threads``: torch's intra-op thread count (default: what `configure_cpu_threads` set earlier in the
        process, else one per core the process may use).
        ``weights`` (CPU, fp32 compute only; with ``dtype="auto"`` a mode other than ``auto`` means fp32):
        ``"fp32"``, ``"bf16-storage"`` (linear weights kept in bf16, each matmul computed in fp32: half the
        memory) or ``"auto"`` (fp32 when it fits in the available
        memory with headroom, else bf16 storage, else int8 layers: see `plan_weights`) or ``"int8"`` (the
        decoder Linears of the ``int8_layers`` selection in int8: `clef_runtime.model.quantize`; refused with
        `OptionsError` off CPU); or ``"fp8"`` (bf16 compute on a CUDA GPU of compute capability 8.9 or newer:
        the decoder Linears of the ``int8_layers`` selection in e4m3, `clef_runtime.model.fp8`; refused with
        `OptionsError` elsewhere and with fp32 compute). ``cpu_kernels``: use clef-runtime's vectorised Gated
        DeltaNet kernels on CPU (equal to transformers' within 1e-5, 2-3x faster). ``fused_kernels``: off CPU,
        use the fused DeltaNet kernels of the ``cuda`` extra where installed (`clef_runtime.model.fused`;
        process-wide).

        Returns the Backbone in eval mode. Raises CheckpointError when the directory is invalid or a text
        tensor is missing, unexpected or misshapen; InsufficientMemoryError; ValueError for a bad device or
        dtype.
        """
        resolved_device = _prepare_device(device, threads, fused_kernels)
        if info is None:
            info = verify_checkpoint(path, parse_tokenizer=False)  # the backbone never reads tokenizer.json
        choice = _compute_choice(dtype, resolved_device, weights, info)
        resolved_dtype = choice.dtype
        # bf16 storage and int8 apply to fp32 compute on CPU: the weights are read in bf16 and stay bf16,
        # int8 (and, on a GPU, fp8) weights are quantised as they are read (no full-precision copy of their
        # layers).
        plan = plan_weights(
            weights, info=info, device=resolved_device, dtype=resolved_dtype, int8_layers=int8_layers
        )
        if check_memory:
            memory.check_fits(
                memory.estimate_model_memory(
                    info,
                    device=resolved_device,
                    dtype=plan.storage_dtype,
                    int8_layers=plan.quantized_layers,
                    quantized_as="fp8" if plan.fp8_layers else "int8",
                )
            )
        model, text_config = _meta_model(info)
        quantization = _quantization_plan(plan)
        quantization.prepare(model)
        _load_text_weights(
            model,
            info,
            lambda name, stored: quantization.convert(
                name, stored, device=resolved_device, dtype=plan.storage_dtype
            ),
        )
        quantization.finish(model)
        _rebuild_buffers(model, text_config, resolved_device, info.path)
        model.requires_grad_(False)
        _apply_weight_mode(model, plan)
        kernels = install_cpu_kernels(model) if cpu_kernels and resolved_device.type == "cpu" else 0
        logger.info(
            "loaded backbone from %s: %d layers, hidden %d, %s compute (%s; weights %s) on %s, %d layers "
            "with CPU kernels",
            info.path,
            text_config.num_hidden_layers,
            text_config.hidden_size,
            choice.name,
            choice.reason,
            plan.label,
            resolved_device,
            kernels,
        )
        return cls(
            model,
            path=info.path,
            info=info,
            compute_dtype=resolved_dtype,
            weight_mode=plan.label,
            dtype_reason=choice.reason,
        )

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
    def dtype_name(self) -> str:
        """The compute dtype's short name: ``fp32``, ``bf16`` or ``fp16``."""
        return dtype_name(self._compute_dtype)

    @property
    def num_parameters(self) -> int:
        """Number of parameters held (text model only: no lm_head, no vision tower)."""
        from clef_runtime.model.fp8 import Fp8Linear
        from clef_runtime.model.quantize import Int8Linear

        quantized = (Int8Linear, Fp8Linear)  # their weights are buffers, not parameters
        held = sum(m.weight.numel() for m in self._model.modules() if isinstance(m, quantized))
        return held + sum(parameter.numel() for parameter in self._model.parameters())

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
        prefill = BatchPrefill(
            self,
            start,
            rows,
            prefill_chunk=prefill_chunk,
            max_call_tokens=self.max_call_tokens if max_call_tokens == "default" else max_call_tokens,
        )
        prefill.advance()
        return [prefill.result(number) for number in range(len(rows))]

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
