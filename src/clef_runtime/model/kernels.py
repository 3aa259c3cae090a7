"""CPU kernels for the Qwen3.5 Gated DeltaNet layers, and the torch thread setup.

transformers 5.24 runs the Gated DeltaNet prefill through two pure-torch fallbacks,
``torch_chunk_gated_delta_rule`` and ``causal_conv1d_fn``. On CPU they cost more than they should:

- the chunked delta rule makes ~25 full passes over [T, heads, 128] tensors (transposes, pads,
  grouped-head repeats, clones for the triangular solves, per-chunk slices that matmul copies),
  and this VM moves memory at only a few GB/s;
- the decays of strongly forgetting heads (transformers initialises rates up to 16 per token)
  reach e^-1000 within a 64-token chunk: ``exp`` of such arguments takes a ~20x slower path, and
  the tiny products become denormal operands that make matmuls and triangular solves ~100x
  slower (measured: a [32, 64, 128] x [32, 128, 128] bmm took 85 ms instead of 0.5 ms, and
  ``linalg_solve_triangular`` took 67 % of a small random model's prefill);
- the depthwise conv goes through a grouped mkldnn convolution over the channel-major layout, and chunked
  prefill first concatenates the cached conv inputs with a transposed view of the projection: both copy
  [T, 8,192] tensors across strides.

This module provides drop-in replacements with the same arguments and results:

- :func:`chunk_gated_delta_rule` - the same chunked algorithm (chunk 64, UT transform,
  sequential inter-chunk state), laid out chunk-major so that every per-chunk operand is a
  contiguous slice, with the UT transform of every chunk done as one batched inverse and two
  batched matmuls, q/k normalised per key head and never repeated per value head, only the two
  state-carrying products in the sequential loop (every chunk's state kept, so that the queries'
  reads of it and the intra-chunk products are each one batched matmul after the scan), and decays
  computed so that neither ``exp``'s underflow path nor denormal matmul operands are hit.
- :func:`causal_conv1d_time_major` - the depthwise causal conv over the [batch, time, channels]
  layout the projection produced, continuing from the cached inputs without concatenating them
  (:func:`causal_conv1d` is the same with transformers' signature).
- :func:`gated_rms_norm` - RMSNorm followed by the SiLU gate in a few in-place passes.

:func:`install_cpu_kernels` binds a forward that uses them to every ``Qwen3_5GatedDeltaNet``
instance of a model (transformers' forward calls module-level functions, so the swap is done per
instance by replacing the bound ``forward``; transformers' files are not touched), and
:func:`uninstall_cpu_kernels` restores the reference forward.
"""

from __future__ import annotations

import contextlib
import os
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3_5 import modeling_qwen3_5 as _qwen3_5

__all__ = [
    "RECOMMENDED_CPU_ENVIRONMENT",
    "causal_conv1d",
    "causal_conv1d_time_major",
    "chunk_gated_delta_rule",
    "configure_cpu_threads",
    "gated_rms_norm",
    "install_cpu_kernels",
    "kernels_installed",
    "uninstall_cpu_kernels",
    "unit_lower_inverse",
]

#: Environment for a CPU inference process. glibc and the OpenMP runtime read these when they start,
#: so they must be in the environment before Python starts (set by a launcher or by re-exec), not
#: set from Python. Measured on the 2-core VM:
#:
#: - the malloc settings keep freed memory in the heap, so that large tensors reuse pages instead
#:   of being mapped and page-faulted in again (measured during development on an AVX2 VM: 2.8x on
#:   a 9B prefill that allocated a fresh fp32 weight per matmul; with bf16 storage's reused scratch
#:   the gain is small);
#: - ``OMP_WAIT_POLICY=PASSIVE`` makes idle OpenMP workers sleep instead of spin. When the cores are
#:   shared with anything else, spinning threads wait at every barrier for a descheduled peer: a
#:   2-thread prefill of the medium benchmark model (T = 1,024) took 19-64 s with the default
#:   policy and 4.7-7.3 s with PASSIVE at load average ~6 (one thread: 4.4-4.9 s). Its cost on an
#:   idle machine (a futex wake per parallel region, a few thousand per prefill) was not measurable
#:   here.
RECOMMENDED_CPU_ENVIRONMENT: dict[str, str] = {
    "MALLOC_MMAP_THRESHOLD_": "17179869184",
    "MALLOC_TRIM_THRESHOLD_": "68719476736",
    "MALLOC_TOP_PAD_": "1073741824",
    "OMP_WAIT_POLICY": "PASSIVE",
}

_INSTALLED_FLAG = "_clef_cpu_kernels"

# Decay factors exp(x) below _DECAY_FLOOR become exactly 0 (see _decay_exp_); exp(-69) < 1e-30.
_LOG_DECAY_FLOOR = -69.0
_DECAY_FLOOR = 1e-30

# Keyword arguments that ask for packed (varlen) sequences. The reference torch fallback refuses
# them, and so do these kernels: they compute one sequence per batch row.
_PACKED_SEQUENCE_KWARGS = ("cu_seqlens", "seq_idx")


def configure_cpu_threads(
    num_threads: int | None = None, *, flush_denormal: bool = True, start_pool: bool = True
) -> int:
    """Set up torch's CPU threading (and denormal flushing) for inference; call it at startup.

    Prefill is a sequence of large GEMMs and elementwise passes, each already parallel inside
    MKL/OpenMP, so all cores go to intra-op parallelism and inter-op parallelism is set to one
    thread. The default is the number of CPUs this process may run on (2 threads ran the
    real-width 4-layer block's fp32 prefill ~1.35x faster than 1 on an unloaded moment). On a
    machine shared with other busy processes, also set :data:`RECOMMENDED_CPU_ENVIRONMENT`'s
    ``OMP_WAIT_POLICY=PASSIVE``, or use fewer threads.

    ``flush_denormal`` turns on flush-to-zero / denormals-are-zero. The decays of the Gated
    DeltaNet state reach 1e-38 and below, and a matmul with denormal operands ran ~100x slower
    here (a [32, 64, 128] x [32, 128, 128] bmm: 85 ms instead of 0.5 ms), so without it a random
    9B-shaped layer spent most of its delta-rule time on denormals. The flag lives in each
    thread's MXCSR and OpenMP worker threads copy it when they are created, so this must run
    before the first parallel torch operation of the process (creating tensors of more than a
    few thousand elements counts). It starts the pool with flushing on, then turns flushing off
    again in the calling thread: model code runs under :func:`flush_denormals`, everything else
    (JSON parsing, rendering) keeps IEEE semantics.

    Each thread that runs a parallel torch operation gets an OpenMP team of its own (GNU OpenMP), and
    a team that stays alive slows every other: libgomp counts all their threads, and once they outnumber
    the CPUs it makes idle workers sleep after ~1,000 spins instead of ~300,000, so each of the thousands
    of small parallel regions of a forward pass pays a futex wake-up. Measured on 2 cores (hidden-512
    model): a warm request 127-133 ms when one thread does all the compute, 170-210 ms when the main
    thread had started a team and another thread then computed. So a process whose model runs on a
    worker thread (``clef serve``, Ray replicas) passes ``start_pool=False`` here and starts the team on
    that thread with :func:`start_thread_pool`; teams of threads that exit go with them.

    Args:
        num_threads: intra-op threads; ``None`` means the count an earlier call set (a Ray replica sets
            its ``--ray-num-cpus`` before the model loads), else every CPU in the process's affinity mask.
        flush_denormal: also set flush-to-zero (results differ from IEEE by < 1.2e-38 per value).
        start_pool: start the calling thread's OpenMP team now (with flush-to-zero): for the thread that
            will run the model.

    Returns:
        The intra-op thread count now in effect (``torch.get_num_threads()``).

    Raises:
        ValueError: if ``num_threads`` is given and is smaller than 1.
    """
    global _CONFIGURED_THREADS
    if num_threads is None and _CONFIGURED_THREADS is not None:
        num_threads = _CONFIGURED_THREADS
    if num_threads is None:
        try:
            num_threads = len(os.sched_getaffinity(0))
        except AttributeError:  # platforms without sched_getaffinity (macOS)
            num_threads = os.cpu_count() or 1
    if num_threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {num_threads}")
    _CONFIGURED_THREADS = num_threads
    torch.set_num_threads(num_threads)
    # Only allowed before the first inter-op parallel work; later calls keep what is set.
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    if flush_denormal and start_pool:
        start_thread_pool()
    return torch.get_num_threads()


_CONFIGURED_THREADS: int | None = None


def start_thread_pool() -> None:
    """Start the calling thread's OpenMP team with flush-to-zero on, so that its workers copy the flag into
    their own MXCSR (see :func:`configure_cpu_threads`). Call it first thing on the thread that runs the
    model; idempotent."""
    with flush_denormals():
        torch.mm(torch.ones(256, 256), torch.ones(256, 256))


@contextlib.contextmanager
def flush_denormals() -> Iterator[None]:
    """Flush denormals to zero in the calling thread for the duration of the block (model compute).

    Kept out of the rest of the process on purpose: with flush-to-zero on, Python itself parses
    ``1e-310`` as ``0.0``, which would change how a request's JSON is rendered into the prompt.
    The OpenMP workers set up by :func:`configure_cpu_threads` keep flushing on their own.
    """
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def causal_conv1d(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    out_dtype: torch.dtype | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Depthwise causal conv1d, a drop-in for transformers' ``causal_conv1d_fn`` (torch path).

    ``out[b, c, t] = act(bias[c] + sum_j weight[c, j] * x[b, c, t - (K - 1) + j])`` with zeros
    before the start: :func:`causal_conv1d_time_major` on the [batch, time, channels] view (the GDN
    forward hands in ``in_proj_qkv(x).transpose(1, 2)``, whose transpose back is contiguous).

    Args:
        hidden_states: [batch, channels, time] (any strides).
        weight: [channels, K] depthwise filter.
        bias: optional [channels].
        activation: ``None``, ``"silu"`` or ``"swish"`` (applied in place), or another
            transformers activation name.
        out_dtype: the result's dtype (default ``hidden_states.dtype``).
        **kwargs: accepted for signature compatibility; ``seq_idx`` (packed sequences) is refused.

    Returns:
        [batch, channels, time] in ``out_dtype`` (a transposed view of a [batch, time, channels]
        tensor), computed in fp32.

    Raises:
        ValueError: if packed-sequence arguments are given.
    """
    _refuse_packed_sequences(kwargs)
    out = causal_conv1d_time_major(hidden_states.transpose(1, 2), weight, bias, activation)
    return out.transpose(1, 2).to(out_dtype or hidden_states.dtype)


def causal_conv1d_time_major(
    sequence: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    previous: torch.Tensor | None = None,
) -> torch.Tensor:
    """Depthwise causal conv1d over [batch, time, channels], continuing from ``previous`` inputs.

    One fp32 time-major buffer holds the K - 1 inputs before the sequence (the tail of ``previous``,
    zeros where there is none) and then the sequence; filling it is the only copy, reading the
    projection's [batch, time, channels] output in its own layout and upcasting in the same pass. A
    depthwise convolution over that buffer as a channels-last image does the rest in one pass.
    transformers' chunked prefill instead concatenates the cached state with the channel-major view
    of the projection, and its transposed copies cost more than the conv itself. Measured on 2 cores
    of a Xeon with AMX, [1, 1,024, 8,192] bf16 after a cached state (medians of 7 and 15 runs): 92 ms
    for that concatenation and a conv over it, 39-41 ms for K shifted multiply-adds over this
    buffer, 23 ms for the channels-last convolution. fp32 throughout: bf16 elementwise arithmetic on
    CPUs converts both ways at every operation.

    Args:
        sequence: [batch, time, channels] (any strides, any float dtype).
        weight: [channels, K] depthwise filter.
        bias: optional [channels].
        activation: ``None``, ``"silu"`` or ``"swish"`` (applied in place), or another
            transformers activation name.
        previous: optional [batch, channels, P] inputs that came before ``sequence`` (a cached conv
            state); its last K - 1 columns are used (zeros before it when P < K - 1).

    Returns:
        [batch, time, channels] fp32, contiguous.
    """
    batch, seq_len, channels = sequence.shape
    lead = weight.shape[-1] - 1
    weight = weight.float()
    padded = torch.empty(batch, lead + seq_len, channels, dtype=torch.float32, device=sequence.device)
    carried = 0 if previous is None else min(lead, previous.shape[-1])
    padded[:, : lead - carried].zero_()
    if carried and previous is not None:  # carried > 0 only with a previous state
        padded[:, lead - carried : lead].copy_(previous[..., -carried:].transpose(1, 2))
    padded[:, lead:].copy_(sequence)
    # The time-major buffer is a channels-last [batch, channels, 1, time] image: oneDNN's depthwise
    # convolution reads it in place, vectorised over channels, and writes channels-last too.
    out = F.conv2d(
        padded.transpose(1, 2).unsqueeze(2),
        weight.view(channels, 1, 1, lead + 1),
        None if bias is None else bias.float(),
        groups=channels,
    )
    out = out.squeeze(2).transpose(1, 2)
    if activation in ("silu", "swish"):
        F.silu(out, inplace=True)
    elif activation is not None:
        out = _qwen3_5.ACT2FN[activation](out)
    return out


def unit_lower_inverse(strictly_lower: torch.Tensor) -> torch.Tensor:
    """Inverse of ``I + L`` for a batch of strictly lower triangular ``L``.

    One batched triangular solve against the identity (LAPACK/MKL trsm). Measured for 1,024
    matrices of 64 x 64 on one core: 8 ms, against 16 ms for recursive block doubling in torch
    and 68 ms for solving the two 128-column right-hand sides of a chunk directly. A
    Neumann/product series would be cheaper still but loses everything to cancellation when the
    entries of ``L`` are large, so it is not used.

    Args:
        strictly_lower: [..., n, n]; only the strictly lower triangle is read (the diagonal and
            the upper triangle may hold anything).

    Returns:
        [..., n, n] ``(I + tril(L, -1))^-1``, unit lower triangular, same dtype.

    Raises:
        ValueError: if the matrices are not square.
    """
    size = strictly_lower.shape[-1]
    if strictly_lower.ndim < 2 or strictly_lower.shape[-2] != size:
        raise ValueError(f"need square matrices, got shape {tuple(strictly_lower.shape)}")
    identity = torch.eye(size, dtype=strictly_lower.dtype, device=strictly_lower.device).expand_as(
        strictly_lower
    )
    return torch.linalg.solve_triangular(strictly_lower, identity, upper=False, unitriangular=True)


def _decay_exp_(log_decay: torch.Tensor) -> torch.Tensor:
    """In-place ``exp`` of log-decays, with every factor below ~1e-30 set to exactly 0.

    Two CPU slow paths hide here. ``exp`` of an argument below about -87 (the result underflows)
    runs ~20x slower than in range (measured: 4M values in [-500, 0] take 70 ms instead of 3 ms,
    -inf included), and decays of strongly forgetting heads reach -1000 within one chunk. And a
    denormal operand makes a matmul ~100x slower unless flush-to-zero is on in every thread
    (see :func:`configure_cpu_threads`), while tiny decays multiplied into the state produce
    exactly such operands. Clamping the argument and zeroing factors below 1e-30 changes each
    product by less than 1e-30 of its size.
    """
    # torch.threshold_ is F.threshold_ (the same builtin); torch's stubs declare only the former.
    return torch.threshold_(log_decay.clamp_(min=_LOG_DECAY_FLOOR).exp_(), _DECAY_FLOOR, 0.0)


def _refuse_packed_sequences(kwargs: dict[str, Any]) -> None:
    for name in _PACKED_SEQUENCE_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(f"`{name}` (packed sequences) is not supported by the clef CPU kernels")


def _to_chunks(
    sequence: torch.Tensor, chunk_size: int, num_chunks: int, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, T, H, D] -> fp32 [num_chunks, B, H, C, D], zero-padded at the end, times ``scale``.

    ``scale`` ([B, T, H, 1] or [B, T, H, D]) is multiplied in during the one copy.
    """
    batch, seq_len, heads, dim = sequence.shape
    chunked = torch.empty(
        num_chunks, batch, heads, chunk_size, dim, dtype=torch.float32, device=sequence.device
    )
    target = chunked.permute(1, 0, 3, 2, 4)  # [B, N, C, H, D] view of the chunk-major buffer
    full = seq_len // chunk_size
    rest = seq_len - full * chunk_size
    # (destination, length, the (chunks, chunk) split of a run of full chunks or None, start)
    pieces: list[tuple[torch.Tensor, int, tuple[int, int] | None, int]] = []
    if full:
        pieces.append((target[:, :full], full * chunk_size, (full, chunk_size), 0))
    if rest:
        pieces.append((target[:, full, :rest], rest, None, full * chunk_size))
        target[:, full, rest:].zero_()
    for destination, length, split, start in pieces:
        source = sequence[:, start : start + length]
        factor = None if scale is None else scale[:, start : start + length]
        if split is not None:
            source = source.unflatten(1, split)
            factor = None if factor is None else factor.unflatten(1, split)
        if factor is None:
            destination.copy_(source)
        else:
            torch.mul(source, factor, out=destination)
    return chunked


def _gates_to_chunks(gate: torch.Tensor, chunk_size: int, num_chunks: int) -> torch.Tensor:
    """[B, T, H] -> fp32 [num_chunks, B, H, C], zero-padded at the end."""
    return _to_chunks(gate.unsqueeze(-1), chunk_size, num_chunks).squeeze(-1)


def chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunked gated delta rule: a drop-in for transformers' ``torch_chunk_gated_delta_rule``.

    Per value head, with state ``S`` [dk, dv] (zero or ``initial_state``) and for every token:
    ``S <- exp(g_t) S``; ``S <- S + k_t (beta_t (v_t - S^T k_t))^T``; ``o_t = S^T q_t``, where q, k
    are optionally L2-normalised and q is scaled by ``dk ** -0.5``. Computed chunk-wise like the
    reference (UT transform per chunk, sequential only across chunks) in fp32.

    Args:
        query, key: [B, T, Hk, dk]; each key head serves ``Hv // Hk`` consecutive value heads.
        value: [B, T, Hv, dv].
        g: [B, T, Hv] log-decay (<= 0).
        beta: [B, T, Hv] write strength.
        chunk_size: tokens per chunk (64 in transformers).
        initial_state: optional [B, Hv, dk, dv] state to start from (not modified).
        output_final_state: return the state after the last token.
        use_qk_l2norm_in_kernel: L2-normalise q and k (eps 1e-6 inside the rsqrt, like FLA).
        **kwargs: accepted for signature compatibility; packed sequences (``cu_seqlens``) are refused.

    Returns:
        ``(output, final_state)``: output [B, T, Hv, dv] contiguous in ``query.dtype``;
        final_state [B, Hv, dk, dv] fp32, or ``None`` unless ``output_final_state``.

    Raises:
        ValueError: if packed-sequence arguments are given or Hv is not a multiple of Hk.
    """
    _refuse_packed_sequences(kwargs)
    output_dtype = query.dtype
    device = query.device
    batch, seq_len, key_heads, key_dim = key.shape
    value_heads, value_dim = value.shape[-2:]
    if value_heads % key_heads:
        raise ValueError(f"value heads ({value_heads}) must be a multiple of key heads ({key_heads})")
    group = value_heads // key_heads
    num_chunks = max(1, -(-seq_len // chunk_size))
    query_scale = key_dim**-0.5

    # Normalise q and k per key head (the reference first repeats them for every value head: twice
    # the work and two copies), fold the 1/sqrt(dk) query scale into the same multiplier, and write
    # them chunk-major in one pass.
    query32 = query.float()
    key32 = key.float()
    if use_qk_l2norm_in_kernel:
        query_factor = query32.square().sum(-1, keepdim=True).add_(1e-6).rsqrt_().mul_(query_scale)
        key_factor = key32.square().sum(-1, keepdim=True).add_(1e-6).rsqrt_()
        query_chunks = _to_chunks(query32, chunk_size, num_chunks, query_factor)  # [N, B, Hk, C, dk]
    else:
        key_factor = None
        query_chunks = _to_chunks(query32, chunk_size, num_chunks).mul_(query_scale)
    key_chunks = _to_chunks(key32, chunk_size, num_chunks, key_factor)
    beta_chunks = _gates_to_chunks(beta.float(), chunk_size, num_chunks)  # [N, B, Hv, C]
    # v * beta: the only form in which v enters the UT transform.
    value_chunks = _to_chunks(value.float(), chunk_size, num_chunks, beta.float().unsqueeze(-1))
    cum_decay = _gates_to_chunks(g.float(), chunk_size, num_chunks).cumsum_(-1)  # [N, B, Hv, C]
    del query32, key32

    flat_key_heads = batch * key_heads
    flat_value_heads = batch * value_heads
    # Grouped views: a value head j of batch b is (b, j // group, j % group) = [N, B*Hk, group, ...].
    query_chunks = query_chunks.view(num_chunks, flat_key_heads, chunk_size, key_dim)
    key_chunks = key_chunks.view(num_chunks, flat_key_heads, chunk_size, key_dim)
    cum_decay = cum_decay.view(num_chunks, flat_key_heads, group, chunk_size)
    beta_chunks = beta_chunks.view(num_chunks, flat_key_heads, group, chunk_size)

    # Within-chunk pairwise decays exp(gamma_i - gamma_j) for j <= i, 0 above the diagonal (masked
    # after the exp: the reference's -inf fill would send every upper entry down exp's slow path).
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=device).triu_(1)
    pairwise_decay = _decay_exp_(cum_decay.unsqueeze(-1) - cum_decay.unsqueeze(-2)).masked_fill_(upper, 0.0)
    # q k^T and k k^T once per key head, shared by the value heads of its group.
    query_key = torch.matmul(query_chunks, key_chunks.transpose(-1, -2)).unsqueeze(2)
    key_key = torch.matmul(key_chunks, key_chunks.transpose(-1, -2)).unsqueeze(2)
    intra_attention = query_key * pairwise_decay  # [N, B*Hk, group, C, C]
    del query_key
    # UT system: strictly lower part of diag(beta) (k k^T * D); reuse the pairwise buffer.
    # Only its strictly lower triangle is read below (the unit diagonal is implied).
    ut_lower = pairwise_decay.mul_(key_key).mul_(beta_chunks.unsqueeze(-1))
    del key_key

    decay_exp = _decay_exp_(cum_decay.clone())  # [N, B*Hk, group, C]
    # Right-hand sides of the UT transform: v*beta and k*beta*exp(gamma).
    key_beta_decayed = key_chunks.unsqueeze(2) * (beta_chunks * decay_exp).unsqueeze(-1)
    value_chunks = value_chunks.view(num_chunks, flat_key_heads, group, chunk_size, value_dim)
    ut_inverse = unit_lower_inverse(ut_lower)
    new_values = torch.matmul(ut_inverse, value_chunks)
    state_reads = torch.matmul(ut_inverse, key_beta_decayed)
    del ut_inverse, ut_lower, key_beta_decayed, value_chunks

    # Decays applied once: q reads the state decayed to its position; k writes it decayed to the
    # chunk end.
    query_decayed = query_chunks.unsqueeze(2) * decay_exp.unsqueeze(-1)
    key_to_end = key_chunks.unsqueeze(2) * _decay_exp_(cum_decay[..., -1:] - cum_decay).unsqueeze(-1)
    chunk_decay = decay_exp[..., -1].reshape(num_chunks, flat_value_heads, 1, 1)
    del query_chunks, key_chunks, decay_exp

    # Chunk-major [N, B*Hv, C, d]: every per-chunk operand below is a contiguous slice.
    new_values = new_values.view(num_chunks, flat_value_heads, chunk_size, value_dim)
    state_reads = state_reads.view(num_chunks, flat_value_heads, chunk_size, key_dim)
    query_decayed = query_decayed.view(num_chunks, flat_value_heads, chunk_size, key_dim)
    key_to_end_t = key_to_end.view(num_chunks, flat_value_heads, chunk_size, key_dim).transpose(-1, -2)

    # states[c] is the state every chunk before c left (states[0] the initial one): the scan writes each
    # into its own slot, so that the queries can read all of them in one batched product afterwards and
    # only the two products that carry the state stay in the sequential loop.
    states = torch.empty(
        num_chunks + 1, flat_value_heads, key_dim, value_dim, dtype=torch.float32, device=device
    )
    if initial_state is None:
        states[0].zero_()
    else:
        states[0].copy_(initial_state.reshape(flat_value_heads, key_dim, value_dim))
    for chunk in range(num_chunks):
        chunk_values = new_values[chunk]
        # v_new = u - W S: the part of the chunk's values the carried state does not predict.
        chunk_values.baddbmm_(state_reads[chunk], states[chunk], alpha=-1.0)
        following = states[chunk + 1]
        torch.mul(states[chunk], chunk_decay[chunk], out=following)
        following.baddbmm_(key_to_end_t[chunk], chunk_values)
    # What each chunk's queries read from the carried state, then the within-chunk attention, for all
    # chunks at once.
    output_chunks = torch.bmm(
        query_decayed.reshape(-1, chunk_size, key_dim), states[:num_chunks].view(-1, key_dim, value_dim)
    )
    output_chunks.baddbmm_(
        intra_attention.reshape(-1, chunk_size, chunk_size), new_values.view(-1, chunk_size, value_dim)
    )
    del intra_attention, new_values, state_reads, query_decayed, key_to_end, key_to_end_t

    output = torch.empty(batch, seq_len, value_heads, value_dim, dtype=output_dtype, device=device)
    _from_chunks(output_chunks.view(num_chunks, batch, value_heads, chunk_size, value_dim), output)
    # A copy, so that a caller keeping the final state does not keep every chunk's state alive.
    final_state = (
        states[num_chunks].view(batch, value_heads, key_dim, value_dim).clone()
        if output_final_state
        else None
    )
    return output, final_state


def _from_chunks(chunked: torch.Tensor, output: torch.Tensor) -> None:
    """Copy fp32 [N, B, H, C, D] into [B, T, H, D] (dropping the padding), casting to its dtype."""
    chunk_size = chunked.shape[3]
    seq_len = output.shape[1]
    source = chunked.permute(1, 0, 3, 2, 4)  # [B, N, C, H, D]
    full = seq_len // chunk_size
    rest = seq_len - full * chunk_size
    if full:
        output[:, : full * chunk_size].unflatten(1, (full, chunk_size)).copy_(source[:, :full])
    if rest:
        output[:, full * chunk_size :].copy_(source[:, full, :rest])


def gated_rms_norm(
    hidden_states: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``weight * RMSNorm(x) * silu(gate)`` over the last dim, for fp32 inputs.

    Same result as ``Qwen3_5RMSNormGated`` when ``hidden_states``, ``gate`` and ``weight`` are
    fp32; the caller must own ``gate`` (it is overwritten with ``silu(gate)``).

    Args:
        hidden_states: [..., D] fp32.
        gate: [..., D] fp32, consumed.
        weight: [D].
        eps: variance epsilon.

    Returns:
        A new [..., D] fp32 tensor.
    """
    mean_square = hidden_states.square().mean(-1, keepdim=True)
    normalised = hidden_states * mean_square.add_(eps).rsqrt_()
    normalised.mul_(weight)
    return normalised.mul_(F.silu(gate, inplace=True))


def _gated_delta_net_forward(
    self: _qwen3_5.Qwen3_5GatedDeltaNet,
    hidden_states: torch.Tensor,
    cache: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """``Qwen3_5GatedDeltaNet.forward`` (transformers 5.24 and 5.25) with the CPU kernels of this module.

    The cache sees what the reference forward would leave in it: the last K conv inputs (handed over
    by :func:`_keep_conv_inputs`), the token count transformers 5.25 keeps per linear-attention layer,
    and the recurrent state. A cache recording its past for a later ``crop`` (speculative decoding;
    5.25 also keeps intermediate recurrent states there) runs the reference forward itself.
    """
    if cache is None:
        cache = kwargs.pop("cache_params", None)
    else:
        kwargs.pop("cache_params", None)
    if cache is not None and cache.is_recording_past(self.layer_idx):
        return type(self).forward(self, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    hidden_states = _qwen3_5.apply_mask_to_padding_states(hidden_states, attention_mask)
    batch, seq_len, _ = hidden_states.shape
    if cache is not None:
        conv_state = cache.get_conv_state(self.layer_idx, state_idx=0)
        recurrent_state = cache.get_recurrent_state(self.layer_idx, state_idx=0)
    else:
        conv_state, recurrent_state = None, None

    projected = self.in_proj_qkv(hidden_states)  # [batch, time, channels]
    z = self.in_proj_z(hidden_states).reshape(batch, seq_len, -1, self.head_v_dim)
    b = self.in_proj_b(hidden_states)
    a = self.in_proj_a(hidden_states)
    _refuse_packed_sequences(kwargs)
    conv_weight = self.conv1d.weight.squeeze(1)

    if conv_state is not None and seq_len == 1:  # cached single-token decode: the state is updated in place
        mixed_qkv = _qwen3_5.causal_conv1d_update(
            projected.transpose(1, 2), conv_state, conv_weight, self.conv1d.bias, self.activation
        ).transpose(1, 2)
        _count_in_place_token(cache, self.layer_idx)
    else:
        # fp32 out: the delta rule computes in fp32 whatever the model's dtype (bf16 states would drift).
        # The conv reads the cached inputs before this chunk directly, instead of from the cache's
        # concatenation of them with the whole chunk.
        mixed_qkv = causal_conv1d_time_major(
            projected, conv_weight, self.conv1d.bias, self.activation, previous=conv_state
        )
        if cache is not None:
            _keep_conv_inputs(cache, self.layer_idx, projected, self.conv_kernel_size)

    query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    query = query.reshape(batch, seq_len, -1, self.head_k_dim)
    key = key.reshape(batch, seq_len, -1, self.head_k_dim)
    value = value.reshape(batch, seq_len, -1, self.head_v_dim)

    beta = b.sigmoid()
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
    cu_seqlens = kwargs.pop("cu_seq_lens_q", None)
    # One token after a cached state: the recurrent form; otherwise the chunked one.
    rule = (
        _qwen3_5.torch_recurrent_gated_delta_rule
        if recurrent_state is not None and seq_len == 1
        else chunk_gated_delta_rule
    )
    core_out, last_state = rule(
        query,
        key,
        value,
        g=g,
        beta=beta,
        initial_state=recurrent_state,
        output_final_state=cache is not None,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu_seqlens,
    )
    if cache is not None:
        cache.update_recurrent_state(last_state, self.layer_idx)

    core_out = core_out.reshape(-1, self.head_v_dim)
    z = z.reshape(-1, self.head_v_dim)
    norm = self.norm
    if core_out.dtype == torch.float32 and type(norm).forward is _qwen3_5.Qwen3_5RMSNormGated.forward:
        # The norm in fp32 (bf16 models too: their delta rule output is fp32 already). z is this forward's
        # own projection output (or its fp32 copy), so gated_rms_norm may overwrite it.
        core_out = gated_rms_norm(core_out, z.float(), norm.weight.float(), norm.variance_epsilon)
    else:
        core_out = norm(core_out, z)
    return self.out_proj(core_out.reshape(batch, seq_len, -1).to(hidden_states.dtype))


def _keep_conv_inputs(cache: Any, layer_idx: int, projected: torch.Tensor, kernel_size: int) -> None:
    """Leave in ``cache`` what the reference's ``update_conv_state(projected)`` would: the last
    ``kernel_size`` conv inputs of the sequence so far, and (transformers >= 5.25) the layer's token count.

    Only the last ``kernel_size`` inputs are handed over, so the cache concatenates and copies a few
    columns instead of the whole chunk; its new state comes out the same, since it keeps the last
    ``kernel_size`` columns of [old state, handed inputs] either way. transformers 5.25 also counts the
    layer's tokens by the width it is handed, so the rest of the chunk is added to that count here.
    """
    tail = projected[:, -kernel_size:].transpose(1, 2)
    cache.update_conv_state(tail, layer_idx, conv_kernel_size=kernel_size)
    counted = getattr(cache.layers[layer_idx], "cumulative_length_linear", None)
    if counted is not None:
        counted.add_(projected.shape[1] - tail.shape[-1])


def _count_in_place_token(cache: Any, layer_idx: int) -> None:
    """transformers >= 5.25 counts a decoded token whose conv state was updated in place (``increase_count``);
    5.24 keeps no such count."""
    increase = getattr(cache, "increase_count", None)
    if increase is not None:
        increase(layer_idx, 0)


def _gated_delta_net_layers(model: nn.Module) -> list[_qwen3_5.Qwen3_5GatedDeltaNet]:
    return [module for module in model.modules() if isinstance(module, _qwen3_5.Qwen3_5GatedDeltaNet)]


def _on_cpu(layer: _qwen3_5.Qwen3_5GatedDeltaNet) -> bool:
    return layer.in_proj_qkv.weight.device.type == "cpu"


def install_cpu_kernels(model: nn.Module) -> int:
    """Make every Gated DeltaNet layer of ``model`` use this module's CPU kernels.

    Works on a ``Qwen3_5TextModel``, any model containing one, or a single layer. Each
    ``Qwen3_5GatedDeltaNet`` instance whose weights are on the CPU gets a bound ``forward`` (an
    instance attribute shadowing the class's); layers on other devices, other instances and the
    class are unchanged. Idempotent. Call :func:`configure_cpu_threads` at process start as well:
    without flush-to-zero the delta rule can still meet denormals.

    Args:
        model: the module tree to patch.

    Returns:
        The number of Gated DeltaNet layers that now use the kernels (0 for a model on a GPU).
    """
    installed = 0
    for layer in _gated_delta_net_layers(model):
        if not _on_cpu(layer):
            continue
        if not getattr(layer, _INSTALLED_FLAG, False):
            layer.forward = types.MethodType(_gated_delta_net_forward, layer)
            setattr(layer, _INSTALLED_FLAG, True)
        installed += 1
    return installed


def uninstall_cpu_kernels(model: nn.Module) -> int:
    """Restore transformers' reference forward on every Gated DeltaNet layer of ``model``.

    Returns:
        The number of layers that had the kernels installed and were restored.
    """
    restored = 0
    for layer in _gated_delta_net_layers(model):
        if getattr(layer, _INSTALLED_FLAG, False):
            del layer.forward
            delattr(layer, _INSTALLED_FLAG)
            restored += 1
    return restored


def kernels_installed(model: nn.Module) -> bool:
    """Return True if every Gated DeltaNet layer of ``model`` (at least one) uses the CPU kernels."""
    layers = _gated_delta_net_layers(model)
    return bool(layers) and all(getattr(layer, _INSTALLED_FLAG, False) for layer in layers)
