"""CPU kernels for the Gated DeltaNet: parity with transformers' torch fallbacks and with naive loops.

Each kernel is checked twice: against transformers' own reference function (what it replaces) and
against a straightforward per-token / per-tap implementation written here in float64.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache, Qwen3_5TextConfig
from transformers import cache_utils as hf_cache_utils
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen3_5

from clef_runtime.model import kernels
from clef_runtime.model.kernels import (
    causal_conv1d,
    causal_conv1d_time_major,
    chunk_gated_delta_rule,
    configure_cpu_threads,
    gated_rms_norm,
    install_cpu_kernels,
    kernels_installed,
    uninstall_cpu_kernels,
    unit_lower_inverse,
)

TOLERANCE = 1e-5

# (model, ids, reference chunked-prefill outputs by chunk size, reference full-pass output)
ModelAndReference = tuple[torch.nn.Module, torch.Tensor, dict[int, torch.Tensor], torch.Tensor]

# Seconds alone, over a minute on a shared 2-core machine (see below).
pytestmark = pytest.mark.slow


def naive_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token definition in float64: S <- e^g S; S <- S + k (beta (v - S^T k))^T; o = S^T q."""
    batch, seq_len, key_heads, key_dim = key.shape
    value_heads, value_dim = value.shape[-2:]
    group = value_heads // key_heads
    q = query.double()
    k = key.double()
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * key_dim**-0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q.repeat_interleave(group, dim=2)
    k = k.repeat_interleave(group, dim=2)
    state = (
        torch.zeros(batch, value_heads, key_dim, value_dim, dtype=torch.float64)
        if initial_state is None
        else initial_state.double().clone()
    )
    outputs = []
    for t in range(seq_len):
        state = state * g[:, t].double().exp()[..., None, None]
        predicted = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        delta = (value[:, t].double() - predicted) * beta[:, t].double()[..., None]
        state = state + k[:, t][..., :, None] * delta[..., None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(outputs, dim=1), state


def random_delta_inputs(
    batch: int,
    seq_len: int,
    key_heads: int,
    value_heads: int,
    head_dim: int,
    *,
    with_state: bool,
    max_decay_rate: float = 16.0,
    seed: int = 0,
) -> dict[str, torch.Tensor | None]:
    """Inputs shaped like the GDN layer's: q/k/v as strided views of one projection, Qwen-like decays."""
    generator = torch.Generator().manual_seed(seed)
    mixed = torch.randn(batch, seq_len, head_dim * (2 * key_heads + value_heads), generator=generator)
    query, key, value = torch.split(
        mixed, [key_heads * head_dim, key_heads * head_dim, value_heads * head_dim], dim=-1
    )
    # g = -A softplus(a + dt_bias) with A up to 16, as initialised by transformers: decays down to
    # e^-1000 within one chunk, the range where exp underflows.
    rate = torch.empty(value_heads).uniform_(0.01, max_decay_rate, generator=generator)
    g = -rate * F.softplus(1.0 + 0.5 * torch.randn(batch, seq_len, value_heads, generator=generator))
    return {
        "query": query.reshape(batch, seq_len, key_heads, head_dim),
        "key": key.reshape(batch, seq_len, key_heads, head_dim),
        "value": value.reshape(batch, seq_len, value_heads, head_dim),
        "g": g,
        "beta": torch.rand(batch, seq_len, value_heads, generator=generator),
        "initial_state": (
            torch.randn(batch, value_heads, head_dim, head_dim, generator=generator) * 0.1
            if with_state
            else None
        ),
    }


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Run this module single-threaded: its many small ops stall at OpenMP barriers when the
    2-core machine is shared (measured: the same module took 6 s alone and 70 s under load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


# (batch, T, key heads, value heads, head dim): the real heads (16 k / 32 v x 128) and small ones.
DELTA_CASES = [
    (1, 1, 16, 32, 128),
    (1, 64, 16, 32, 128),
    (1, 130, 16, 32, 128),
    (2, 63, 2, 4, 32),
    (2, 65, 2, 4, 32),
    (1, 200, 4, 4, 16),
]


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize(("batch", "seq_len", "key_heads", "value_heads", "head_dim"), DELTA_CASES)
def test_chunk_gated_delta_rule_matches_transformers_and_naive(
    batch: int, seq_len: int, key_heads: int, value_heads: int, head_dim: int, with_state: bool
) -> None:
    inputs = random_delta_inputs(batch, seq_len, key_heads, value_heads, head_dim, with_state=with_state)
    state_before = None if inputs["initial_state"] is None else inputs["initial_state"].clone()
    common = {"output_final_state": True, "use_qk_l2norm_in_kernel": True}
    output, final_state = chunk_gated_delta_rule(**inputs, **common)
    reference_output, reference_state = hf_qwen3_5.torch_chunk_gated_delta_rule(**inputs, **common)
    naive_output, naive_state = naive_gated_delta_rule(**inputs)

    assert output.shape == reference_output.shape == (batch, seq_len, value_heads, head_dim)
    assert output.dtype == torch.float32 and output.is_contiguous()
    assert final_state is not None and final_state.shape == reference_state.shape
    assert max_abs(output, reference_output) < TOLERANCE
    assert max_abs(final_state, reference_state) < TOLERANCE
    assert max_abs(output, naive_output) < TOLERANCE
    assert max_abs(final_state, naive_state) < TOLERANCE
    if state_before is not None:
        assert torch.equal(inputs["initial_state"], state_before), "the initial state must not be modified"


def test_chunk_gated_delta_rule_without_l2norm_and_with_other_chunk_size() -> None:
    inputs = random_delta_inputs(1, 90, 2, 4, 32, with_state=True, seed=3)
    # Without the in-kernel L2 norm the caller normalises the keys (else the delta rule diverges).
    inputs["key"] = F.normalize(inputs["key"], dim=-1)
    inputs["query"] = F.normalize(inputs["query"], dim=-1)
    for chunk_size in (64, 16, 48):
        output, state = chunk_gated_delta_rule(**inputs, chunk_size=chunk_size, output_final_state=True)
        reference_output, reference_state = hf_qwen3_5.torch_chunk_gated_delta_rule(
            **inputs, chunk_size=chunk_size, output_final_state=True
        )
        assert max_abs(output, reference_output) < TOLERANCE
        assert max_abs(state, reference_state) < TOLERANCE


def test_chunk_gated_delta_rule_final_state_only_when_asked() -> None:
    inputs = random_delta_inputs(1, 10, 2, 2, 16, with_state=False)
    _, state = chunk_gated_delta_rule(**inputs, use_qk_l2norm_in_kernel=True)
    assert state is None


def test_chunk_gated_delta_rule_keeps_bf16_io_like_the_reference() -> None:
    inputs = random_delta_inputs(1, 70, 2, 4, 32, with_state=False)
    half = {name: (None if t is None else t.to(torch.bfloat16)) for name, t in inputs.items()}
    output, _ = chunk_gated_delta_rule(**half, use_qk_l2norm_in_kernel=True)
    reference_output, _ = hf_qwen3_5.torch_chunk_gated_delta_rule(**half, use_qk_l2norm_in_kernel=True)
    assert output.dtype == torch.bfloat16
    # Both compute in fp32 from the same bf16 inputs; only the final rounding to bf16 can differ.
    assert max_abs(output, reference_output) < 2e-2


def test_chunk_gated_delta_rule_refuses_packed_sequences() -> None:
    inputs = random_delta_inputs(1, 8, 2, 2, 16, with_state=False)
    with pytest.raises(ValueError, match="packed"):
        chunk_gated_delta_rule(**inputs, cu_seqlens=torch.tensor([0, 4, 8]))


def test_unit_lower_inverse_inverts_unit_lower_matrices() -> None:
    generator = torch.Generator().manual_seed(1)
    # The diagonal and upper triangle hold garbage that must be ignored.
    garbage = torch.randn(5, 3, 64, 64, generator=generator)
    inverse = unit_lower_inverse(garbage)
    unit_lower = garbage.tril(-1) + torch.eye(64)
    expected = torch.linalg.inv(unit_lower.double())
    assert torch.allclose(inverse.double(), expected, atol=1e-6 * expected.abs().max().item())
    assert torch.equal(inverse.triu(1), torch.zeros_like(inverse))
    with pytest.raises(ValueError, match="square"):
        unit_lower_inverse(torch.zeros(2, 3, 4))


def naive_causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """out[b, c, t] = bias[c] + sum_j weight[c, j] x[b, c, t - K + 1 + j], in float64, per tap."""
    kernel_size = weight.shape[-1]
    padded = F.pad(x.double(), (kernel_size - 1, 0))
    seq_len = x.shape[-1]
    out = sum(padded[:, :, j : j + seq_len] * weight[:, j, None].double() for j in range(kernel_size))
    if bias is not None:
        out = out + bias.double()[:, None]
    return out


@pytest.mark.parametrize("seq_len", [1, 2, 3, 4, 5, 100])
@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("layout", ["time_major_view", "channel_major"])
def test_causal_conv1d_matches_transformers_and_naive(
    seq_len: int, activation: str | None, with_bias: bool, layout: str
) -> None:
    generator = torch.Generator().manual_seed(seq_len)
    channels = 48
    if layout == "time_major_view":  # what the GDN forward passes: in_proj_qkv(x).transpose(1, 2)
        x = torch.randn(2, seq_len, channels, generator=generator).transpose(1, 2)
    else:  # what chunked prefill passes: torch.cat([conv_state, new], -1)
        x = torch.randn(2, channels, seq_len, generator=generator)
    weight = torch.randn(channels, 4, generator=generator)
    bias = torch.randn(channels, generator=generator) if with_bias else None
    out = causal_conv1d(x, weight, bias, activation=activation)
    reference = hf_qwen3_5.causal_conv1d_fn(x, weight, bias, activation=activation)
    naive = naive_causal_conv(x, weight, bias)
    if activation == "silu":
        naive = F.silu(naive)
    assert out.shape == reference.shape == (2, channels, seq_len)
    assert max_abs(out, reference) < TOLERANCE
    assert max_abs(out, naive) < TOLERANCE


@pytest.mark.parametrize("previous_len", [0, 1, 3, 4])
@pytest.mark.parametrize("seq_len", [1, 2, 7])
def test_causal_conv1d_time_major_continues_from_previous_inputs(previous_len: int, seq_len: int) -> None:
    """The conv of a chunk that follows cached inputs equals the tail of the conv of the whole
    concatenation (what transformers' chunked prefill computes); fewer cached inputs than K - 1 read as
    zeros before them."""
    generator = torch.Generator().manual_seed(previous_len * 10 + seq_len)
    channels = 24
    previous = torch.randn(2, channels, previous_len, generator=generator)
    sequence = torch.randn(2, seq_len, channels, generator=generator)
    weight = torch.randn(channels, 4, generator=generator)
    bias = torch.randn(channels, generator=generator)
    out = causal_conv1d_time_major(
        sequence, weight, bias, "silu", previous=previous if previous_len else None
    )
    whole = torch.cat([previous, sequence.transpose(1, 2)], dim=-1)
    expected = F.silu(naive_causal_conv(whole, weight, bias))[:, :, -seq_len:].transpose(1, 2)
    assert out.shape == (2, seq_len, channels) and out.dtype == torch.float32 and out.is_contiguous()
    assert max_abs(out, expected) < TOLERANCE


def test_causal_conv1d_time_major_upcasts_bf16_once_and_equals_the_fp32_conv() -> None:
    generator = torch.Generator().manual_seed(3)
    sequence = torch.randn(1, 9, 16, generator=generator).bfloat16()
    previous = torch.randn(1, 16, 4, generator=generator).bfloat16()
    weight = torch.randn(16, 4, generator=generator).bfloat16()
    out = causal_conv1d_time_major(sequence, weight, previous=previous)
    exact = causal_conv1d_time_major(sequence.float(), weight.float(), previous=previous.float())
    assert out.dtype == torch.float32
    assert torch.equal(out, exact)


def test_causal_conv1d_refuses_packed_sequences() -> None:
    with pytest.raises(ValueError, match="packed"):
        causal_conv1d(torch.zeros(1, 4, 8), torch.zeros(4, 4), seq_idx=torch.zeros(1, 8, dtype=torch.int32))


def test_gated_rms_norm_matches_the_module() -> None:
    generator = torch.Generator().manual_seed(2)
    module = hf_qwen3_5.Qwen3_5RMSNormGated(128, eps=1e-6)
    with torch.no_grad():
        module.weight.copy_(torch.randn(128, generator=generator))
    x = torch.randn(300, 128, generator=generator)
    gate = torch.randn(300, 128, generator=generator)
    expected = module(x, gate)
    out = gated_rms_norm(x, gate.clone(), module.weight, module.variance_epsilon)
    assert max_abs(out, expected) < TOLERANCE
    # Independent formula in float64.
    x64, gate64 = x.double(), gate.double()
    naive = (
        module.weight.double() * x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + 1e-6) * F.silu(gate64)
    )
    assert max_abs(out, naive) < TOLERANCE


def small_config(**overrides: object) -> Qwen3_5TextConfig:
    """4 layers (3 GDN + 1 attention), small width; GDN heads 2 k / 4 v x 32 unless overridden."""
    settings: dict[str, object] = {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
    }
    settings.update(overrides)
    return Qwen3_5TextConfig(**settings)


def build_model(
    config: Qwen3_5TextConfig, seed: int = 0, *, mild_decay: bool = False
) -> hf_qwen3_5.Qwen3_5TextModel:
    """A random model; ``mild_decay`` lowers the decay rates from transformers' init (up to 16 per
    token, which sends the reference delta rule into slow denormal arithmetic) to at most 0.5."""
    torch.manual_seed(seed)
    model = hf_qwen3_5.Qwen3_5TextModel(config).eval()
    with torch.no_grad():  # non-trivial norm weights, so that a wrong one shows
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.add_(0.1 * torch.randn_like(parameter))
            elif name.endswith("A_log") and mild_decay:
                parameter.copy_(torch.empty_like(parameter).uniform_(0.01, 0.5).log())
    return model


def chunked_prefill(model: torch.nn.Module, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    cache = DynamicCache(config=model.config)
    parts = []
    for start in range(0, ids.shape[1], chunk):
        out = model(input_ids=ids[:, start : start + chunk], cache=cache, use_cache=True)
        parts.append(out.last_hidden_state)
    return torch.cat(parts, dim=1)


@pytest.fixture(scope="module")
def small_model_and_reference() -> ModelAndReference:
    model = build_model(small_config())
    ids = torch.randint(0, 512, (2, 230), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        full = model(input_ids=ids).last_hidden_state
        chunked = {chunk: chunked_prefill(model, ids, chunk) for chunk in (64, 100)}
    return model, ids, chunked, full


def test_install_counts_layers_and_uninstall_restores(
    small_model_and_reference: ModelAndReference,
) -> None:
    model, ids, _, full = small_model_and_reference
    assert not kernels_installed(model)
    assert install_cpu_kernels(model) == 3
    assert install_cpu_kernels(model) == 3  # idempotent
    assert kernels_installed(model)
    layer = model.layers[0].linear_attn
    assert layer.forward.__func__ is kernels._gated_delta_net_forward
    assert uninstall_cpu_kernels(model) == 3
    assert uninstall_cpu_kernels(model) == 0
    assert not kernels_installed(model)
    with torch.inference_mode():
        assert torch.equal(model(input_ids=ids).last_hidden_state, full)


def test_model_forward_with_kernels_matches_reference(
    small_model_and_reference: ModelAndReference,
) -> None:
    model, ids, reference_chunked, full = small_model_and_reference
    install_cpu_kernels(model)
    try:
        with torch.inference_mode():
            assert max_abs(model(input_ids=ids).last_hidden_state, full) < 1e-4
            for chunk, reference in reference_chunked.items():
                ours = chunked_prefill(model, ids, chunk)
                assert max_abs(ours, reference) < 1e-4
                assert max_abs(ours, full) < 1e-4
    finally:
        uninstall_cpu_kernels(model)


def conv_states(cache: DynamicCache) -> list[torch.Tensor]:
    return [layer.conv_states[0] for layer in cache.layers if hasattr(layer, "conv_states")]


def kernel_conv_states_against_reference(
    model: torch.nn.Module, run: Callable[[], tuple[torch.Tensor, DynamicCache]]
) -> list[torch.Tensor]:
    """Run ``run`` with transformers' forward, then with the kernels installed; check the hidden rows and the
    conv inputs each cache keeps, and return the kernels' kept inputs."""
    with torch.inference_mode():
        reference, reference_cache = run()
        install_cpu_kernels(model)
        ours, our_cache = run()
    assert max_abs(ours, reference) < 1e-4
    # Positions come from the cache's token count (per linear-attention layer on transformers >= 5.25).
    assert our_cache.get_seq_length() == reference_cache.get_seq_length() == reference.shape[1]
    ours_states, reference_states = conv_states(our_cache), conv_states(reference_cache)
    assert len(ours_states) == len(reference_states) == 3
    # The first layer reads the same embeddings, so its kept inputs are the same bits; later layers read
    # hidden rows that differ by rounding.
    assert torch.equal(ours_states[0], reference_states[0])
    for mine, theirs in zip(ours_states, reference_states, strict=True):
        assert mine.shape == theirs.shape
        assert max_abs(mine, theirs) < 1e-4
    return ours_states


@pytest.mark.parametrize("chunks", [(3,) * 20, (2, 1, 5, 64, 3, 1, 100)])
def test_chunked_prefill_with_kernels_keeps_the_reference_conv_states(chunks: tuple[int, ...]) -> None:
    """Chunks shorter than the conv kernel and single tokens between longer chunks: the same hidden rows
    as transformers' own path, and the cache keeps exactly the conv inputs the reference keeps."""
    model = build_model(small_config(), seed=4, mild_decay=True)
    ids = torch.randint(0, 512, (1, sum(chunks)), generator=torch.Generator().manual_seed(8))

    def run() -> tuple[torch.Tensor, DynamicCache]:
        cache = DynamicCache(config=model.config)
        parts, start = [], 0
        for length in chunks:
            out = model(input_ids=ids[:, start : start + length], cache=cache, use_cache=True)
            parts.append(out.last_hidden_state)
            start += length
        return torch.cat(parts, dim=1), cache

    kept = kernel_conv_states_against_reference(model, run)
    assert all(state.shape[-1] == 4 for state in kept)  # the kernel's width, nothing more


def test_recording_cache_runs_the_reference_forward() -> None:
    """A cache recording its past for a later crop (speculative decoding) gets exactly what transformers'
    own forward leaves in it, kernels installed or not: every conv input since recording began (and, on
    transformers >= 5.25, the intermediate recurrent states it was asked to keep)."""
    model = build_model(small_config(), seed=5, mild_decay=True)
    ids = torch.randint(0, 512, (1, 30), generator=torch.Generator().manual_seed(9))
    keeps_states = (
        "recurrent_states_to_keep"
        in inspect.signature(hf_cache_utils.LinearAttentionLayer.activate_past_recording).parameters
    )

    def run() -> tuple[torch.Tensor, DynamicCache]:
        cache = DynamicCache(config=model.config)
        parts = [model(input_ids=ids[:, :20], cache=cache, use_cache=True).last_hidden_state]
        for layer in cache.layers:
            if hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording(**({"recurrent_states_to_keep": 2} if keeps_states else {}))
        parts.append(model(input_ids=ids[:, 20:], cache=cache, use_cache=True).last_hidden_state)
        return torch.cat(parts, dim=1), cache

    with torch.inference_mode():
        reference, reference_cache = run()
        install_cpu_kernels(model)
        ours, our_cache = run()
    assert max_abs(ours, reference) < 1e-4
    ours_states, reference_states = conv_states(our_cache), conv_states(reference_cache)
    assert torch.equal(ours_states[0], reference_states[0])  # the first layer reads the same embeddings
    for mine, theirs in zip(ours_states, reference_states, strict=True):
        assert mine.shape == theirs.shape == (1, theirs.shape[1], 4 + 10)
        assert max_abs(mine, theirs) < 1e-4


def test_model_with_kernels_single_token_steps_and_padding_mask() -> None:
    model = build_model(small_config(), seed=1, mild_decay=True)
    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(6))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :7] = 0  # left padding in row 1
    with torch.inference_mode():
        reference_masked = model(input_ids=ids, attention_mask=mask).last_hidden_state
        reference_steps = chunked_prefill(model, ids, 1)
        install_cpu_kernels(model)
        masked = model(input_ids=ids, attention_mask=mask).last_hidden_state
        steps = chunked_prefill(model, ids, 1)  # first call prefill, then cached one-token decode
    assert max_abs(masked, reference_masked) < 1e-4
    assert max_abs(steps, reference_steps) < 1e-4


def test_model_with_real_head_dims_matches_reference() -> None:
    config = small_config(
        hidden_size=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
    )
    model = build_model(config, seed=2, mild_decay=True)
    ids = torch.randint(0, 512, (1, 150), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        full = model(input_ids=ids).last_hidden_state
        reference_chunked = chunked_prefill(model, ids, 64)
        install_cpu_kernels(model)
        assert max_abs(model(input_ids=ids).last_hidden_state, full) < 1e-4
        assert max_abs(chunked_prefill(model, ids, 64), reference_chunked) < 1e-4


def test_install_works_on_a_single_layer_and_a_model_without_gdn() -> None:
    model = build_model(small_config())
    assert install_cpu_kernels(model.layers[1]) == 1
    assert kernels_installed(model.layers[1].linear_attn)
    assert not kernels_installed(model)  # layers 0 and 2 untouched
    assert install_cpu_kernels(torch.nn.Linear(2, 2)) == 0
    assert not kernels_installed(torch.nn.Linear(2, 2))
    with torch.device("meta"):  # not on the CPU: left alone
        elsewhere = hf_qwen3_5.Qwen3_5TextModel(small_config())
    assert install_cpu_kernels(elsewhere) == 0
    assert not kernels_installed(elsewhere)


def test_configure_cpu_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    monkeypatch.setattr(kernels, "_CONFIGURED_THREADS", None)  # restored after the test
    try:
        assert configure_cpu_threads(flush_denormal=False) >= 1  # nothing set yet: every CPU
        assert configure_cpu_threads(1, flush_denormal=False) == 1
        assert torch.get_num_threads() == 1
        # None keeps what was set (a Ray replica's --ray-num-cpus survives the model load's call)
        assert configure_cpu_threads(flush_denormal=False) == 1
        with pytest.raises(ValueError):
            configure_cpu_threads(0)
    finally:
        torch.set_num_threads(before)
