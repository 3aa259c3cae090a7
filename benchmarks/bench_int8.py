"""``--weights int8`` measured: candidate int8 kernels vs fp32, the 9B release's memory, drift and speed.

Not a test. Sections (``--sections``, all by default), each measured in this one process:

- ``kernels``: at the release's shapes ([T x 4096] @ [4096 x 4096], 4096 -> 12288, 12288 -> 4096 for
  T = 128 / 1024 / 4096), best-of-``--repeats`` seconds of fp32 ``F.linear`` and of each int8 candidate,
  interleaved shape by shape: clef's `Int8Linear` (per-channel int8 weights, per-token int8 activations,
  ``torch._int_mm``), torch's dynamic quantized linear (per-tensor activations) with the fbgemm/x86 and the
  oneDNN packings, oneDNN's ``qlinear_pointwise`` with a per-tensor activation scale, and int8 weight-only
  (``torch._weight_int8pack_mm``). Relative output error vs fp32 for each.
- ``memory``: the 9B release's need from its safetensors layout (header entries built from the release
  geometry, no weights): bf16 storage, int8 late / all with bf16 or fp32 elsewhere.
- ``drift``: ``--requests`` generated requests (varied states, 1-3 questions of each type) decided by the
  medium benchmark model in fp32, int8 ``late`` and int8 ``all``: max and mean |dp| over every option
  probability, top-1 agreement per question; then backbone prefill seconds at ``--prefill-tokens`` for the
  three, interleaved, best of ``--repeats``.

    flock /tmp/clef-bench.lock .venv/bin/python benchmarks/bench_int8.py --json benchmarks/results/int8.json

The lead can re-run the drift with ``clef compare`` (evaluation issue) once it exists.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from clef_runtime.model.quantize import Int8Linear

SECTIONS = ("kernels", "memory", "drift")
KERNEL_SHAPES = ((4096, 4096), (4096, 12288), (12288, 4096))  # (in, out)

#: The release's text geometry (Qwen3.5-9B; public config values, see docs) and its joint head.
RELEASE_TEXT = {
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
}
RELEASE_HEAD = {
    "hidden_size": 4096,
    "width": 1024,
    "routing_layers": 2,
    "layers": 4,
    "heads": 16,
    "feedforward": 4096,
}


def best_seconds(call: Callable[[], Any], repeats: int) -> float:
    """Best wall time of ``repeats`` calls after one untimed warm-up."""
    call()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return best


def machine() -> dict[str, Any]:
    """CPU model, core count, torch version and load average (the machine is shared)."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return {
        "cpu": model or platform.processor(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "amx_int8": " amx_int8" in flags,
        "avx512_vnni": " avx512_vnni" in flags,
        "torch": torch.__version__,
        "loadavg": os.getloadavg(),
    }


# ------------------------------------------------------------------------------------------- kernels


def kernel_candidates(weight: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Each int8 way of computing ``x @ weight.T``, prepared once for ``weight`` [out, in]."""
    candidates: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data = weight
    clef = Int8Linear.from_linear(linear)
    candidates["clef Int8Linear (per-token act, _int_mm)"] = clef
    values, scales = clef.weight, clef.weight_scale
    per_channel = torch.quantize_per_channel(
        weight, scales.double(), torch.zeros(weight.shape[0], dtype=torch.long), 0, torch.qint8
    )
    for engine in ("x86", "onednn"):
        if engine in torch.backends.quantized.supported_engines:
            torch.backends.quantized.engine = engine
            packed = torch.ops.quantized.linear_prepack(per_channel, None)
            candidates[f"quantized.linear_dynamic {engine} (per-tensor act)"] = lambda x, packed=packed: (
                torch.ops.quantized.linear_dynamic(x, packed, False)
            )
    onednn_weight = torch.ops.onednn.qlinear_prepack(values, None)
    zero_points = torch.zeros(weight.shape[0], dtype=torch.int32)

    def qlinear_pointwise(x: torch.Tensor) -> torch.Tensor:
        qx = torch.quantize_per_tensor_dynamic(x, torch.quint8, False)
        return torch.ops.onednn.qlinear_pointwise(
            qx.int_repr(), qx.q_scale(), qx.q_zero_point(), onednn_weight, scales, zero_points,
            None, 1.0, 0, torch.float32, "none", [], "",
        )  # fmt: skip

    candidates["onednn qlinear_pointwise (per-tensor act)"] = qlinear_pointwise
    candidates["weight-only _weight_int8pack_mm"] = lambda x: torch._weight_int8pack_mm(x, values, scales)
    return candidates


def section_kernels(args: argparse.Namespace) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    rows = []
    for inner, outer in KERNEL_SHAPES:
        weight = torch.randn(outer, inner, generator=generator) * 0.02
        candidates = kernel_candidates(weight)
        for tokens in args.kernel_tokens:
            x = torch.randn(tokens, inner, generator=generator)
            with torch.inference_mode():
                exact = F.linear(x, weight)
                fp32_s = best_seconds(lambda x=x, weight=weight: F.linear(x, weight), args.repeats)
                row: dict[str, Any] = {"T": tokens, "in": inner, "out": outer, "fp32_s": round(fp32_s, 4)}
                row["fp32_gflops"] = round(2 * tokens * inner * outer / fp32_s / 1e9, 1)
                for name, call in candidates.items():
                    if name.startswith("weight-only") and tokens > args.weight_only_max_tokens:
                        continue  # measured ~1 GFLOP/s at T = 1024 here: minutes per call beyond
                    out = call(x)
                    seconds = best_seconds(lambda call=call, x=x: call(x), args.repeats)
                    error = ((out - exact).norm() / exact.norm()).item()
                    row[name] = {
                        "s": round(seconds, 4),
                        "speedup_vs_fp32": round(fp32_s / seconds, 2),
                        "relative_error": round(error, 5),
                    }
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    return {"rows": rows}


# -------------------------------------------------------------------------------------------- memory


def release_info() -> Any:
    """A `CheckpointInfo` with the 9B release's tensor names and shapes (bf16 headers), built from its
    geometry on the meta device: no weights, no files."""
    from clef_runtime.model.checkpoint import CheckpointInfo, TensorInfo
    from clef_runtime.model.tiny import _backbone_shapes, _head_shapes, random_checkpoint_config

    config = random_checkpoint_config(text_overrides=RELEASE_TEXT)
    backbone = _backbone_shapes(config)
    head = _head_shapes(RELEASE_HEAD)
    tensors = {name: TensorInfo(name, "meta", "BF16", shape) for name, shape in backbone.items()}
    head_tensors = {name: TensorInfo(name, "meta", "BF16", shape) for name, shape in head.items()}
    return CheckpointInfo(
        path=Path("release-geometry"),
        config=config,
        head_config=RELEASE_HEAD,
        shards=(),
        total_weight_bytes=sum(t.nbytes for t in tensors.values()),
        tensor_count=len(tensors),
        is_tiny=False,
        tensors=tensors,
        head_tensors=head_tensors,
    )


def section_memory(args: argparse.Namespace) -> dict[str, Any]:
    from clef_runtime.model.memory import estimate_model_memory
    from clef_runtime.model.quantize import select_int8_layers

    info = release_info()
    text_params = sum(t.numel for n, t in info.tensors.items() if n.startswith("model.language_model."))
    rows = {}
    for label, dtype, spec in (
        ("fp32", torch.float32, None),
        ("bf16-storage", torch.bfloat16, None),
        ("int8 late (12-31) + fp32", torch.float32, "late"),
        ("int8 late (12-31) + bf16-storage", torch.bfloat16, "late"),
        ("int8 all + bf16-storage", torch.bfloat16, "all"),
    ):
        layers = select_int8_layers(spec, 32) if spec else ()
        estimate = estimate_model_memory(info, device="cpu", dtype=dtype, int8_layers=layers)
        rows[label] = {
            "total_gb": round(estimate.total_bytes / 1e9, 2),
            "text_gb": round(estimate.text_bytes / 1e9, 2),
            "describe": estimate.describe(),
        }
    return {"tensors": len(info.tensors), "text_params": text_params, "estimates": rows}


# --------------------------------------------------------------------------------------------- drift

_WORDS = [
    "account",
    "billing",
    "refund",
    "invoice",
    "error",
    "crash",
    "login",
    "password",
    "payment",
    "card",
    "order",
    "delivery",
    "late",
    "broken",
    "screen",
    "update",
    "server",
    "outage",
    "slow",
    "timeout",
    "database",
    "backup",
    "customer",
    "angry",
    "happy",
    "thanks",
    "please",
    "urgent",
    "week",
    "today",
    "tomorrow",
    "price",
    "discount",
    "plan",
    "upgrade",
    "cancel",
    "support",
    "ticket",
    "email",
    "phone",
    "chat",
    "bug",
    "feature",
    "request",
    "report",
    "data",
    "export",
    "import",
    "sync",
    "mobile",
    "app",
    "desktop",
    "browser",
    "cache",
    "cookie",
    "network",
    "the",
    "a",
    "to",
    "of",
    "and",
    "is",
    "was",
    "not",
    "it",
    "we",
    "you",
    "they",
    "my",
    "our",
    "your",
    "this",
    "that",
    "with",
    "for",
    "on",
    "at",
    "from",
]


def generated_requests(count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` requests: states of 10-200 words (text or a small JSON object), 1-3 questions each
    (noul, choice with 2-6 options, score with 3-5 levels)."""
    rng = random.Random(seed)
    requests = []
    for index in range(count):
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(10, 200)))
        state: Any = words if rng.random() < 0.7 else {"ticket": index, "body": words, "tags": ["a", "b"]}
        questions: dict[str, Any] = {}
        for number in range(rng.randint(1, 3)):
            kind = rng.choice(("noul", "choice", "score"))
            if kind == "noul":
                questions[f"q{number}"] = {"type": "noul", "instructions": f"is it {rng.choice(_WORDS)}?"}
            elif kind == "choice":
                options = rng.sample(_WORDS, rng.randint(2, 6))
                questions[f"q{number}"] = {"type": "choice", "criteria": {w: f"about {w}" for w in options}}
            else:
                questions[f"q{number}"] = {"type": "score", "criteria": rng.sample(_WORDS, rng.randint(3, 5))}
        requests.append({"state": state, "questions": questions})
    return requests


def answer_vectors(response: dict[str, Any]) -> list[list[float]]:
    """Each answer's probabilities as a list (a noul answer: [p, 1 - p])."""
    vectors = []
    for answer in response["answers"].values():
        if answer["type"] == "noul":
            vectors.append([answer["noul"], 1.0 - answer["noul"]])
        else:
            vectors.append(list(answer["probabilities"].values()))
    return vectors


def medium_checkpoint() -> Path:
    """The medium benchmark checkpoint (built once into the user cache by ``engine_bench.py``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from engine_bench import ensure_medium_checkpoint

    return ensure_medium_checkpoint()


def section_drift(args: argparse.Namespace) -> dict[str, Any]:
    from clef_runtime.engine.clef import Clef
    from clef_runtime.model.backbone import Backbone

    path = medium_checkpoint()
    requests = generated_requests(args.requests, args.seed)
    variants = {"fp32": {"weights": "fp32"}, "int8 late": {"weights": "int8", "int8_layers": "late"}}
    variants["int8 all"] = {"weights": "int8", "int8_layers": "all"}
    vectors: dict[str, list[list[list[float]]]] = {}
    seconds: dict[str, float] = {}
    for name, options in variants.items():
        clef = Clef.load(str(path), cache_mb=0, **options)
        started = time.perf_counter()
        vectors[name] = [answer_vectors(clef.decide(request)) for request in requests]
        seconds[name] = round(time.perf_counter() - started, 1)
        print(f"{name}: {len(requests)} requests in {seconds[name]} s", file=sys.stderr, flush=True)
        del clef
        gc.collect()
    report: dict[str, Any] = {"requests": len(requests), "decide_seconds": seconds}
    questions = sum(len(v) for v in vectors["fp32"])
    for name in ("int8 late", "int8 all"):
        diffs, agree = [], 0
        for exact_request, other_request in zip(vectors["fp32"], vectors[name], strict=True):
            for exact, other in zip(exact_request, other_request, strict=True):
                diffs += [abs(a - b) for a, b in zip(exact, other, strict=True)]
                agree += exact.index(max(exact)) == other.index(max(other))
        report[name] = {
            "max_abs_dp": round(max(diffs), 4),
            "mean_abs_dp": round(statistics.fmean(diffs), 5),
            "top1_agreement": f"{agree}/{questions}",
        }

    # Prefill speed: the three backbones side by side, interleaved.
    backbones = {
        name: Backbone.load(path, device="cpu", **{k: v for k, v in options.items()})
        for name, options in variants.items()
    }
    ids = [random.Random(1).randrange(1000, 200_000) for _ in range(args.prefill_tokens)]
    best = {name: float("inf") for name in backbones}
    for backbone in backbones.values():
        backbone.hidden_states(ids[:64])  # warm-up
    for _ in range(args.repeats):
        for name, backbone in backbones.items():
            started = time.perf_counter()
            backbone.hidden_states(ids)
            best[name] = min(best[name], time.perf_counter() - started)
    report["prefill"] = {
        "tokens": args.prefill_tokens,
        "seconds": {name: round(value, 3) for name, value in best.items()},
        "speedup_vs_fp32": {name: round(best["fp32"] / value, 2) for name, value in best.items()},
    }
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--kernel-tokens", type=int, nargs="+", default=[128, 1024, 4096])
    parser.add_argument("--weight-only-max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--prefill-tokens", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the raw results here")
    args = parser.parse_args()

    from clef_runtime.model.kernels import configure_cpu_threads

    configure_cpu_threads()
    result: dict[str, Any] = {
        "benchmark": "bench_int8",
        "machine": machine(),
        "args": vars(args) | {"json": None},
    }
    sections = {"kernels": section_kernels, "memory": section_memory, "drift": section_drift}
    for name in args.sections:
        started = time.perf_counter()
        result[name] = sections[name](args)
        result[name]["wall_s"] = round(time.perf_counter() - started, 1)
    result["loadavg_end"] = os.getloadavg()
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
