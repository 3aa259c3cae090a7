"""Backbone: loading from the release layout, prefill (full / chunked / batched), and the memory estimate.

Parity is checked against an independent implementation of the Qwen3.5 text stack written here from the
specification (docs/model.md section 4, transformers' modeling_qwen3_5.py): per-token gated delta rule,
explicit causal conv, gated attention with partial interleaved M-RoPE, zero-centred RMSNorms.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from clef_runtime.model.backbone import Backbone
from clef_runtime.model.checkpoint import CheckpointError, verify_checkpoint
from clef_runtime.model.memory import (
    InsufficientMemoryError,
    MemoryEstimate,
    available_memory,
    check_fits,
    estimate_model_memory,
)
from clef_runtime.model.state import BackboneState, Continuation, UnsupportedCacheError

ENDOFTEXT = 248_044


def _ids(length: int, seed: int) -> list[int]:
    """Real-ish ids: mostly ordinary vocabulary, with a few special tokens mixed in."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 151_000, (length,), generator=generator)
    ids[:: max(1, length // 7)] = 248_045  # <|im_start|>
    return ids.tolist()


# ----------------------------------------------------------------------------- independent reference


class _Reference:
    """The Qwen3.5 text stack from the spec, fp32, one sequence, per-token recurrence."""

    def __init__(self, directory: Path) -> None:
        self.config = json.loads((directory / "config.json").read_text())["text_config"]
        index = json.loads((directory / "model.safetensors.index.json").read_text())
        prefix = "model.language_model."
        self.weights: dict[str, Tensor] = {}
        for shard in sorted(set(index["weight_map"].values())):
            with safe_open(str(directory / shard), framework="pt") as reader:
                for name in reader.keys():  # noqa: SIM118
                    if name.startswith(prefix):
                        self.weights[name[len(prefix) :]] = reader.get_tensor(name).float()

    def _norm(self, x: Tensor, weight: Tensor) -> Tensor:  # zero-centred RMSNorm
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config["rms_norm_eps"]) * (1 + weight)

    def _delta_net(self, h: Tensor, p: str) -> Tensor:
        c, w = self.config, self.weights
        length = h.shape[0]
        heads_k, heads_v = c["linear_num_key_heads"], c["linear_num_value_heads"]
        dim_k, dim_v = c["linear_key_head_dim"], c["linear_value_head_dim"]
        qkv = h @ w[p + "in_proj_qkv.weight"].T
        kernel = w[p + "conv1d.weight"][:, 0, :]  # [C, K]
        width = kernel.shape[1]
        padded = torch.cat([torch.zeros(width - 1, qkv.shape[1]), qkv])
        conv = sum(padded[j : j + length] * kernel[:, j] for j in range(width))
        conv = F.silu(conv)
        q, k, v = torch.split(conv, [heads_k * dim_k, heads_k * dim_k, heads_v * dim_v], dim=-1)
        q, k, v = (
            q.view(length, heads_k, dim_k),
            k.view(length, heads_k, dim_k),
            v.view(length, heads_v, dim_v),
        )
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * dim_k**-0.5
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        beta = torch.sigmoid(h @ w[p + "in_proj_b.weight"].T)
        decay = -w[p + "A_log"].exp() * F.softplus(h @ w[p + "in_proj_a.weight"].T + w[p + "dt_bias"])
        group = heads_v // heads_k  # value head j reads key head j // group
        state = torch.zeros(heads_v, dim_k, dim_v)
        out = torch.zeros(length, heads_v, dim_v)
        for t in range(length):
            k_t, q_t = k[t].repeat_interleave(group, 0), q[t].repeat_interleave(group, 0)
            state = state * decay[t].exp()[:, None, None]
            correction = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", state, k_t))
            state = state + k_t[:, :, None] * correction[:, None, :]
            out[t] = torch.einsum("hkv,hk->hv", state, q_t)
        z = (h @ w[p + "in_proj_z.weight"].T).view(length, heads_v, dim_v)
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.config["rms_norm_eps"])
        out = out * w[p + "norm.weight"] * F.silu(z)
        return out.reshape(length, heads_v * dim_v) @ w[p + "out_proj.weight"].T

    def _rope(self, planes: Tensor) -> tuple[Tensor, Tensor]:
        c = self.config
        rope = c["rope_parameters"]
        rotary = int(c["head_dim"] * rope["partial_rotary_factor"])
        inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, rotary, 2, dtype=torch.float32) / rotary))
        section = rope["mrope_section"]
        # Interleaved M-RoPE: frequency j uses plane H if j % 3 == 1 (within H's share), W if j % 3 == 2
        # (within W's share), else T.
        plane_of = [
            1 if j % 3 == 1 and j < 3 * section[1] else 2 if j % 3 == 2 and j < 3 * section[2] else 0
            for j in range(rotary // 2)
        ]
        angles = torch.stack([planes[plane_of[j]].float() * inv_freq[j] for j in range(rotary // 2)], dim=-1)
        return torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    def _attention(self, h: Tensor, p: str, planes: Tensor) -> Tensor:
        c, w = self.config, self.weights
        length, heads, kv_heads, dim = (
            h.shape[0],
            c["num_attention_heads"],
            c["num_key_value_heads"],
            c["head_dim"],
        )
        query_gate = (h @ w[p + "q_proj.weight"].T).view(length, heads, 2 * dim)
        query, gate = query_gate[..., :dim], query_gate[..., dim:].reshape(length, heads * dim)
        query = self._norm(query, w[p + "q_norm.weight"])
        key = self._norm((h @ w[p + "k_proj.weight"].T).view(length, kv_heads, dim), w[p + "k_norm.weight"])
        value = (h @ w[p + "v_proj.weight"].T).view(length, kv_heads, dim)
        cos, sin = self._rope(planes)
        rotary = cos.shape[-1]

        def rotate(x: Tensor) -> Tensor:
            part, rest = x[..., :rotary], x[..., rotary:]
            half = rotary // 2
            turned = torch.cat([-part[..., half:], part[..., :half]], -1)
            return torch.cat([part * cos[:, None] + turned * sin[:, None], rest], -1)

        query, key = rotate(query), rotate(key)
        key, value = (
            key.repeat_interleave(heads // kv_heads, 1),
            value.repeat_interleave(heads // kv_heads, 1),
        )
        scores = torch.einsum("thd,shd->hts", query, key) / math.sqrt(dim)
        scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.einsum("hts,shd->thd", scores.softmax(-1), value).reshape(length, heads * dim)
        return (out * torch.sigmoid(gate)) @ w[p + "o_proj.weight"].T

    def hidden(self, ids: list[int], planes: Tensor | None = None) -> Tensor:
        w = self.weights
        if planes is None:
            planes = torch.arange(len(ids)).expand(3, -1)
        x = w["embed_tokens.weight"][torch.tensor(ids)]
        for layer, kind in enumerate(self.config["layer_types"]):
            p = f"layers.{layer}."
            h = self._norm(x, w[p + "input_layernorm.weight"])
            if kind == "linear_attention":
                x = x + self._delta_net(h, p + "linear_attn.")
            else:
                x = x + self._attention(h, p + "self_attn.", planes)
            h = self._norm(x, w[p + "post_attention_layernorm.weight"])
            mlp = p + "mlp."
            x = (
                x
                + (F.silu(h @ w[mlp + "gate_proj.weight"].T) * (h @ w[mlp + "up_proj.weight"].T))
                @ w[mlp + "down_proj.weight"].T
            )
        return self._norm(x, w["norm.weight"])


@pytest.fixture(scope="module")
def reference(tiny_dir: Path) -> _Reference:
    return _Reference(tiny_dir)


def _max_diff(a: Tensor, b: Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


# ------------------------------------------------------------------------------------------- loading


def test_properties(tiny_backbone: Backbone, tiny_dir: Path) -> None:
    info = verify_checkpoint(tiny_dir)
    text_params = sum(t.numel for n, t in info.tensors.items() if n.startswith("model.language_model."))
    assert tiny_backbone.hidden_size == 64
    assert tiny_backbone.dtype == torch.float32
    assert tiny_backbone.device == torch.device("cpu")
    assert tiny_backbone.config.num_hidden_layers == 4
    assert tiny_backbone.num_parameters == text_params
    # Neither the lm_head nor the vision tower is held.
    names = {name for name, _ in tiny_backbone.model.named_parameters()}
    assert not any("lm_head" in name or "visual" in name for name in names)


def test_matches_the_independent_reference(tiny_backbone: Backbone, reference: _Reference) -> None:
    ids = _ids(48, seed=1)
    assert _max_diff(tiny_backbone.hidden_states(ids), reference.hidden(ids)) <= 1e-4


def test_three_plane_positions_match_the_reference(tiny_backbone: Backbone, reference: _Reference) -> None:
    ids = _ids(40, seed=2)
    planes = torch.stack([torch.arange(40), (torch.arange(40) * 3) % 11, (torch.arange(40) * 5) % 13])
    ours = tiny_backbone.hidden_states(ids, position_ids=planes)
    assert _max_diff(ours, reference.hidden(ids, planes)) <= 1e-4
    # The planes matter: plain positions give different rows.
    assert _max_diff(ours, tiny_backbone.hidden_states(ids)) > 1e-3
    # Chunked with explicit planes equals the full pass.
    assert _max_diff(tiny_backbone.hidden_states(ids, position_ids=planes, prefill_chunk=16), ours) <= 1e-4


def test_inputs_embeds_and_default_positions(tiny_backbone: Backbone) -> None:
    ids = _ids(50, seed=3)
    full = tiny_backbone.hidden_states(ids)
    embeds = tiny_backbone.model.embed_tokens.weight[torch.tensor(ids)].detach()
    assert _max_diff(tiny_backbone.hidden_states(ids, inputs_embeds=embeds), full) == 0.0
    arange = torch.arange(50)
    assert _max_diff(tiny_backbone.hidden_states(ids, position_ids=arange), full) == 0.0
    assert _max_diff(tiny_backbone.hidden_states(torch.tensor([ids])), full) == 0.0


# ------------------------------------------------------------------------------------------- prefill


@pytest.mark.parametrize(
    ("chunk", "pad_last"), [(64, True), (17, False), (100, False), (100, True), (1000, True)]
)
def test_chunked_equals_full(tiny_backbone: Backbone, chunk: int, pad_last: bool) -> None:
    ids = _ids(300, seed=4)
    full = tiny_backbone.hidden_states(ids)
    chunked = tiny_backbone.hidden_states(ids, prefill_chunk=chunk, pad_last_chunk=pad_last)
    assert chunked.shape == (300, 64)
    assert _max_diff(chunked, full) <= 1e-4


@pytest.mark.slow
def test_seed_readout_by_hand(tiny_backbone: Backbone) -> None:
    # The seed's form written out independently: ceil(T/64) calls on a cache, the last padded with 248044
    # at the following positions, padded rows dropped.
    from transformers import DynamicCache

    ids = _ids(150, seed=5)
    model = tiny_backbone.model
    cache = DynamicCache(config=model.config)
    pieces = []
    with torch.inference_mode():
        for start in range(0, 150, 64):
            piece = ids[start : start + 64]
            real = len(piece)
            piece = piece + [ENDOFTEXT] * (64 - real)
            positions = torch.arange(start, start + 64)[None]
            out = model(input_ids=torch.tensor([piece]), position_ids=positions, cache=cache, use_cache=True)
            pieces.append(out.last_hidden_state[0, :real])
    by_hand = torch.cat(pieces)
    ours = tiny_backbone.hidden_states(ids, prefill_chunk=64, pad_last_chunk=True)
    assert _max_diff(ours, by_hand) <= 1e-6


@pytest.mark.slow
def test_batch_equals_single(tiny_backbone: Backbone) -> None:
    batch = [_ids(n, seed=10 + n) for n in (300, 17, 129, 64, 1)]
    singles = [tiny_backbone.hidden_states(ids) for ids in batch]
    for chunk in (None, 64):
        results = tiny_backbone.extend(None, [Continuation(ids) for ids in batch], prefill_chunk=chunk)
        rows = [result.hidden for result in results]
        assert [r.shape[0] for r in rows] == [300, 17, 129, 64, 1]
        for single, batched in zip(singles, rows, strict=True):
            assert _max_diff(batched, single) <= 1e-4


@pytest.mark.slow
def test_requests_do_not_leak_into_each_other(tiny_backbone: Backbone) -> None:
    long, short = _ids(400, seed=6), _ids(70, seed=7)
    short_alone = tiny_backbone.hidden_states(short, prefill_chunk=64, pad_last_chunk=True)
    long_alone = tiny_backbone.hidden_states(long, prefill_chunk=64, pad_last_chunk=True)
    tiny_backbone.hidden_states(long, prefill_chunk=64, pad_last_chunk=True)
    assert (
        _max_diff(tiny_backbone.hidden_states(short, prefill_chunk=64, pad_last_chunk=True), short_alone)
        <= 1e-6
    )
    tiny_backbone.hidden_states(short)
    assert (
        _max_diff(tiny_backbone.hidden_states(long, prefill_chunk=64, pad_last_chunk=True), long_alone)
        <= 1e-6
    )


def test_bad_arguments(tiny_backbone: Backbone) -> None:
    with pytest.raises(ValueError, match="empty"):
        tiny_backbone.hidden_states([])
    with pytest.raises(ValueError, match="pad_last_chunk"):
        tiny_backbone.hidden_states([1, 2, 3], pad_last_chunk=True)
    with pytest.raises(ValueError, match="positive"):
        tiny_backbone.hidden_states([1, 2, 3], prefill_chunk=0)
    with pytest.raises(ValueError, match="position_ids"):
        tiny_backbone.hidden_states([1, 2, 3], position_ids=torch.arange(4))
    with pytest.raises(ValueError, match="inputs_embeds"):
        tiny_backbone.hidden_states([1, 2, 3], inputs_embeds=torch.zeros(3, 5))
    with pytest.raises(ValueError, match="empty"):
        tiny_backbone.extend(None, [])
    with pytest.raises(ValueError, match="empty"):
        tiny_backbone.extend(None, [Continuation([1, 2]), Continuation([])])


@pytest.mark.slow
def test_bf16_load_on_cpu(tiny_dir: Path, tiny_backbone: Backbone) -> None:
    backbone = Backbone.load(tiny_dir, device="cpu", dtype="bf16")
    assert backbone.dtype == torch.bfloat16
    ids = _ids(80, seed=8)
    rows = backbone.hidden_states(ids)
    assert rows.dtype == torch.float32
    # bf16 compute drifts from fp32 but stays the same function.
    assert torch.nn.functional.cosine_similarity(rows, tiny_backbone.hidden_states(ids), dim=-1).min() > 0.98


# ------------------------------------------------------------------------------ continuation / states


def _state_tensors(state: BackboneState) -> list[Tensor]:
    return [t for layer in state.layers for t in vars(layer).values()] + [state.hidden]


def test_prefix_state_then_extend_equals_the_full_pass(
    tiny_backbone: Backbone, reference: _Reference
) -> None:
    ids = _ids(120, seed=20)
    full = tiny_backbone.hidden_states(ids)
    prefix = tiny_backbone.initial_state(ids[:36])
    assert (prefix.length, prefix.next_position) == (36, 36)
    assert _max_diff(prefix.hidden, full[:36]) <= 1e-5
    (rest,) = tiny_backbone.extend(prefix, [Continuation(ids[36:])])
    assert rest.snapshot is None
    assert _max_diff(rest.hidden, full[36:]) <= 1e-5
    # And against the independent implementation.
    assert _max_diff(torch.cat([prefix.hidden, rest.hidden]), reference.hidden(ids)) <= 1e-4


def test_continuing_a_snapshot_is_exactly_the_cold_continuation(tiny_backbone: Backbone) -> None:
    ids = _ids(200, seed=21)
    full = tiny_backbone.hidden_states(ids)
    prefix = tiny_backbone.initial_state(ids[:36])
    (cold,) = tiny_backbone.extend(prefix, [Continuation(ids[36:], snapshot_at=90)])
    state = cold.snapshot
    assert state is not None
    assert (state.length, state.next_position) == (126, 126)
    assert _max_diff(state.hidden, full[:126]) <= 1e-5
    (hit,) = tiny_backbone.extend(state, [Continuation(ids[126:])])
    # The cold run was split at the snapshot, so the hit runs the very same call on the same state.
    assert torch.equal(hit.hidden, cold.hidden[90:])
    assert _max_diff(hit.hidden, full[126:]) <= 1e-4
    # A different continuation of the same state equals its own full pass.
    other = ids[:126] + _ids(40, seed=22)
    (branch,) = tiny_backbone.extend(state, [Continuation(other[126:])])
    assert _max_diff(branch.hidden, tiny_backbone.hidden_states(other)[126:]) <= 1e-4


def test_points_and_segments_rebuild_the_snapshot_at_every_point(tiny_backbone: Backbone) -> None:
    ids = _ids(160, seed=23)
    full = tiny_backbone.hidden_states(ids)
    prefix = tiny_backbone.initial_state(ids[:36])
    (cold,) = tiny_backbone.extend(prefix, [Continuation(ids[36:], points=(20, 50, 90), snapshot_at=90)])
    assert cold.segment is not None and cold.segment.length == 90 and len(cold.points) == 3
    assert cold.snapshot is not None
    # The segment and the last point assemble into exactly the whole-state snapshot.
    whole = prefix.assemble([cold.segment], cold.points[2])
    assert (whole.length, whole.next_position) == (cold.snapshot.length, cold.snapshot.next_position)
    assert all(
        torch.equal(a, b) for a, b in zip(_state_tensors(whole), _state_tensors(cold.snapshot), strict=True)
    )
    # Pieces of the segment (as tree nodes hold them) and an inner point resume exactly there.
    head, middle = cold.segment.slice(0, 20), cold.segment.slice(20, 50)
    assert head.nbytes + middle.nbytes + cold.segment.slice(50, 90).nbytes == cold.segment.nbytes
    inner = prefix.assemble([head, middle], cold.points[1])
    assert inner.length == 86 and _max_diff(inner.hidden, full[:86]) <= 1e-5
    (resumed,) = tiny_backbone.extend(inner, [Continuation(ids[86:])])
    assert _max_diff(resumed.hidden, full[86:]) <= 1e-4
    with pytest.raises(ValueError, match="points"):
        tiny_backbone.extend(prefix, [Continuation(ids[36:40], points=(3, 2))])
    with pytest.raises(ValueError):
        cold.segment.slice(10, 10)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [None, 16])
def test_batch_rows_snapshot_at_their_own_offsets(tiny_backbone: Backbone, chunk: int | None) -> None:
    prefix_ids = _ids(36, seed=23)
    rows = [prefix_ids + _ids(n, seed=24 + n) for n in (150, 40, 97)]
    cuts = [100, 3, 97]  # the last one snapshots at its very end
    prefix = tiny_backbone.initial_state(prefix_ids)
    results = tiny_backbone.extend(
        prefix,
        [Continuation(r[36:], snapshot_at=c) for r, c in zip(rows, cuts, strict=True)],
        prefill_chunk=chunk,
    )
    for row, cut, result in zip(rows, cuts, results, strict=True):
        full = tiny_backbone.hidden_states(row)
        assert _max_diff(result.hidden, full[36:]) <= 1e-4
        assert result.snapshot is not None and result.snapshot.length == 36 + cut
        assert _max_diff(result.snapshot.hidden, full[: 36 + cut]) <= 1e-4
        if 36 + cut < len(row):
            (continued,) = tiny_backbone.extend(result.snapshot, [Continuation(row[36 + cut :])])
            assert _max_diff(continued.hidden, full[36 + cut :]) <= 1e-4


def test_one_state_continued_by_a_batch_and_never_modified(tiny_backbone: Backbone) -> None:
    base = _ids(80, seed=30)
    state = tiny_backbone.initial_state(base)
    before = [t.clone() for t in _state_tensors(state)]
    tails = [_ids(n, seed=31 + n) for n in (30, 5, 60)]
    results = tiny_backbone.extend(state, [Continuation(t) for t in tails], prefill_chunk=16)
    for tail, result in zip(tails, results, strict=True):
        assert _max_diff(result.hidden, tiny_backbone.hidden_states(base + tail)[80:]) <= 1e-4
    assert all(torch.equal(a, b) for a, b in zip(before, _state_tensors(state), strict=True))
    assert state.nbytes == sum(t.numel() * t.element_size() for t in before)


def test_image_rows_and_planes_in_extend(tiny_backbone: Backbone) -> None:
    ids = _ids(90, seed=40)
    # A 3x4 "image" of 12 rows at 40..51; planes as M-RoPE lays them out (text after it shifted by 12 - 4).
    image = torch.randn(12, 64, generator=torch.Generator().manual_seed(41))
    k = torch.arange(12)
    planes = torch.empty(3, 90, dtype=torch.long)
    planes[:, :40] = torch.arange(40)
    planes[0, 40:52], planes[1, 40:52], planes[2, 40:52] = 40, 40 + k // 4, 40 + k % 4
    planes[:, 52:] = torch.arange(44, 44 + 38)
    embeds = tiny_backbone.embeddings(ids, image_rows=[(40, image)])
    expected = tiny_backbone.hidden_states(ids, inputs_embeds=embeds, position_ids=planes)
    assert _max_diff(expected, tiny_backbone.hidden_states(ids, position_ids=planes)) > 1e-3  # rows matter
    prefix = tiny_backbone.initial_state(ids[:36])
    (cold,) = tiny_backbone.extend(
        prefix,
        [Continuation(ids[36:], positions=planes[:, 36:], image_rows=[(4, image)], snapshot_at=20)],
        prefill_chunk=8,
    )
    assert _max_diff(cold.hidden, expected[36:]) <= 1e-4
    state = cold.snapshot
    assert state is not None and state.length == 56
    assert state.next_position == 48  # one past the largest position so far (text continues at 44 + 4)
    (hit,) = tiny_backbone.extend(state, [Continuation(ids[56:], positions=planes[:, 56:])])
    assert _max_diff(hit.hidden, expected[56:]) <= 1e-4
    # Without explicit planes a continuation starts at next_position.
    (default,) = tiny_backbone.extend(state, [Continuation(ids[56:])])
    assert torch.equal(default.hidden, hit.hidden)


def test_extend_bad_arguments(tiny_backbone: Backbone, tiny_dir: Path) -> None:
    state = tiny_backbone.initial_state([1, 2, 3])
    with pytest.raises(ValueError, match="empty"):
        tiny_backbone.extend(state, [])
    with pytest.raises(ValueError, match="empty"):
        tiny_backbone.extend(state, [Continuation([5]), Continuation([])])
    with pytest.raises(ValueError, match="snapshot_at"):
        tiny_backbone.extend(state, [Continuation([5, 6], snapshot_at=3)])
    with pytest.raises(ValueError, match="positions"):
        tiny_backbone.extend(state, [Continuation([5, 6], positions=torch.zeros(3, 3, dtype=torch.long))])
    with pytest.raises(ValueError, match="image rows"):
        tiny_backbone.extend(state, [Continuation([5, 6], image_rows=[(1, torch.zeros(2, 64))])])
    with pytest.raises(ValueError, match="positive"):
        tiny_backbone.extend(state, [Continuation([5])], prefill_chunk=0)
    with pytest.raises(ValueError, match="empty"):
        tiny_backbone.initial_state([])
    config = json.loads((tiny_dir / "config.json").read_text())["text_config"]
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    other = Qwen3_5TextConfig.from_dict({**config, "layer_types": ["full_attention"] * 4})
    with pytest.raises(UnsupportedCacheError):
        state.to_cache(other, 1)


# ----------------------------------------------------------------------------------- loading errors


@pytest.mark.slow
def test_missing_text_tensor_is_a_checkpoint_error(clone_tiny: Callable[..., Path]) -> None:
    shard = "model-00003-of-00003.safetensors"
    directory = clone_tiny(shard, "model.safetensors.index.json")
    tensors = load_file(str(directory / shard))
    dropped = "model.language_model.layers.1.linear_attn.A_log"
    del tensors[dropped]
    save_file(tensors, str(directory / shard), metadata={"format": "pt"})
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    del index["weight_map"][dropped]
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    verify_checkpoint(directory)  # consistent index and shards: only the strict load notices
    with pytest.raises(
        CheckpointError, match=r"missing text tensors: \['model.language_model.layers.1.linear_attn"
    ):
        Backbone.load(directory, device="cpu")


@pytest.mark.slow
def test_unexpected_tensor_is_a_checkpoint_error(clone_tiny: Callable[..., Path]) -> None:
    shard = "model-00003-of-00003.safetensors"
    directory = clone_tiny(shard, "model.safetensors.index.json")
    tensors = load_file(str(directory / shard))
    tensors["model.language_model.layers.9.extra.weight"] = torch.zeros(2, dtype=torch.bfloat16)
    save_file(tensors, str(directory / shard), metadata={"format": "pt"})
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.language_model.layers.9.extra.weight"] = shard
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="unexpected tensors"):
        Backbone.load(directory, device="cpu")


@pytest.mark.slow
def test_load_refuses_when_memory_is_short(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import clef_runtime.model.memory as memory

    monkeypatch.setattr(memory, "available_memory", lambda device: 1_000_000)
    with pytest.raises(InsufficientMemoryError):
        Backbone.load(tiny_dir, device="cpu")
    Backbone.load(tiny_dir, device="cpu", check_memory=False)


# ------------------------------------------------------------------------------------- memory estimate


def _write_header_only(path: Path, shapes: dict[str, tuple[int, ...]], dtype: str = "BF16") -> None:
    """A valid safetensors file whose data section is a hole (sparse): headers are real, no disk is used."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in sorted(shapes):
        size = math.prod(shapes[name]) * 2
        header[name] = {"dtype": dtype, "shape": list(shapes[name]), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as handle:
        handle.write(struct.pack("<Q", len(raw)) + raw)
        handle.truncate(8 + len(raw) + offset)


@pytest.fixture(scope="module")
def release_geometry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with the release's 760 tensor headers (Qwen3.5-9B geometry) and the 122-tensor head."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from clef_runtime.model.head import JointSchemaHead

    directory = tmp_path_factory.mktemp("release")
    config = Qwen3_5Config(
        text_config={
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e7,
                "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10],
                "mrope_interleaved": True,
            }
        },
        vision_config={"out_hidden_size": 4096},
        architectures=["Qwen3_5ForConditionalGeneration"],
    )
    with torch.device("meta"):
        model = Qwen3_5ForConditionalGeneration(config)
        head = JointSchemaHead(4096, 1024, 2, 4, 16, 4096)
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    names = sorted(shapes)
    weight_map = {}
    for number in range(4):
        part = names[number::4]
        shard = f"model-{number + 1:05d}-of-00004.safetensors"
        _write_header_only(directory / shard, {name: shapes[name] for name in part})
        weight_map.update(dict.fromkeys(part, shard))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(config.to_diff_dict()))
    _write_header_only(
        directory / "joint_head.safetensors", {n: tuple(t.shape) for n, t in head.state_dict().items()}
    )
    (directory / "joint_head_config.json").write_text(json.dumps(head.config))
    for name in ("tokenizer.json", "tokenizer_config.json", "processor_config.json"):
        (directory / name).write_text("{}")
    return directory


def test_release_geometry_counts(release_geometry: Path) -> None:
    info = verify_checkpoint(release_geometry)
    assert info.tensor_count == 760
    assert sum(t.numel for t in info.tensors.values()) == 9_409_813_744
    assert info.total_weight_bytes == 18_819_627_488
    assert len(info.head_tensors) == 122
    assert sum(t.numel for t in info.head_tensors.values()) == 121_762_820


def test_memory_estimate_of_the_release(release_geometry: Path) -> None:
    info = verify_checkpoint(release_geometry)
    bf16 = estimate_model_memory(info, device="cpu", dtype=torch.bfloat16, include_vision=True)
    assert isinstance(bf16, MemoryEstimate)
    assert bf16.backbone_bytes == 18_819_627_488  # every backbone tensor in bf16: ~18.8 GB
    assert bf16.head_bytes == 121_762_820 * 4
    fp32 = estimate_model_memory(info, device="cpu", dtype=torch.float32, include_vision=True)
    lm_head = 248_320 * 4096
    # ~37.6 GB if every tensor were fp32; the lm_head table stays bf16 (LexicalTable keeps its dtype).
    assert fp32.backbone_bytes + lm_head * 2 == 2 * 18_819_627_488
    text_only = estimate_model_memory(info, device="cpu", dtype=torch.float32)
    assert text_only.vision_bytes == 0
    assert 34e9 < text_only.total_bytes < 38e9
    assert text_only.total_bytes > text_only.weights_bytes

    with pytest.raises(InsufficientMemoryError) as error:
        check_fits(text_only, available=24_000_000_000)
    message = str(error.value)
    assert "fp32" in message and "--device cuda" in message and "bf16-storage" in message
    assert f"~{text_only.total_bytes / 1e9:.1f} GB" in message
    assert error.value.needed_bytes == text_only.total_bytes
    check_fits(estimate_model_memory(info, device="cpu", dtype=torch.bfloat16), available=24_000_000_000)


def test_available_memory_reads_the_system() -> None:
    assert available_memory("cpu") > 100_000_000
