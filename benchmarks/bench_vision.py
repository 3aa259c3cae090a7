"""Time per image of the vision path: decode + preprocess + tower, per mode, on two towers.

- ``tiny``: the built-in tiny checkpoint's tower (depth 2, hidden 32), loaded through ``VisionTower``;
- ``real``: the release's tower geometry (27 blocks x 1152, MLP 4304, 16 heads, out 4096) with random
  weights, written as a bf16 safetensors checkpoint in the release layout and loaded through ``VisionTower``
  in fp32 (so the load time is measured too; ``--real-in-memory`` skips the disk round trip).

Modes: ``native`` (capped at 1,024 tokens) on a 1024x768 photo-like JPEG, ``g256``, ``g448``.
Prints one JSON object (and writes it with ``--json``): every time with its runs, median, min and max. Not
a test: numbers depend on the machine and on its load.

    python -m benchmarks.bench_vision [--reps 3] [--real-reps 3] [--skip-real] [--threads N] [--json OUT]
    python -m benchmarks.bench_vision --quick          # smoke run (tiny tower only, seconds)
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from devtools.results import add_run_arguments, publish, start_report
from devtools.timing import Samples
from PIL import Image, ImageFilter

from clef_runtime.protocol.images import ImageSource
from clef_runtime.vision.decode import decode_image
from clef_runtime.vision.preprocess import preprocess
from clef_runtime.vision.tower import VisionTower

MODES = ("native", "g256", "g448")
REAL_VISION_CONFIG = {
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_heads": 16,
    "out_hidden_size": 4096,
    "num_position_embeddings": 2304,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "hidden_act": "gelu_pytorch_tanh",
    "model_type": "qwen3_5_vision",
}


def photo_like_jpeg(width: int = 1024, height: int = 768, seed: int = 0) -> bytes:
    """A JPEG with photo-like statistics: smooth shapes, gradients, texture and noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    pixels = np.stack(
        [
            120 + 80 * np.sin(x / 97.0) * np.cos(y / 131.0),
            100 + 0.1 * x + 40 * np.sin((x + y) / 53.0),
            140 - 0.08 * y + 30 * np.cos(x / 29.0),
        ],
        axis=-1,
    )
    for _ in range(12):  # a few blobs
        cx, cy, r = rng.uniform(0, width), rng.uniform(0, height), rng.uniform(30, 160)
        mask = ((x - cx) ** 2 + (y - cy) ** 2) < r * r
        pixels[mask] = rng.uniform(0, 255, 3)
    pixels += rng.normal(0, 8, pixels.shape)
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB").filter(
        ImageFilter.GaussianBlur(1)
    )
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def timed(function: Callable[[], Any], reps: int) -> tuple[list[float], Any]:
    """Run ``function`` ``reps`` times; return the wall times in ms and the last result."""
    times = []
    result = None
    for _ in range(reps):
        start = time.perf_counter()
        result = function()
        times.append((time.perf_counter() - start) * 1000)
    return times, result


def summary(times: list[float]) -> dict[str, Any]:
    samples = Samples.of(times)
    return {
        "median_ms": round(samples.median, 2),
        "min_ms": round(samples.min, 2),
        "max_ms": round(samples.max, 2),
        "runs": len(times),
        "samples_ms": [round(value, 2) for value in samples.values],
    }


def write_real_checkpoint(directory: Path, seed: int) -> float:
    """Random real-width tower weights as a bf16 release-layout checkpoint; returns the write time in s."""
    from safetensors.torch import save_file
    from transformers import Qwen3_5VisionConfig, Qwen3_5VisionModel

    start = time.perf_counter()
    torch.manual_seed(seed)
    model = Qwen3_5VisionModel(Qwen3_5VisionConfig(**REAL_VISION_CONFIG))
    tensors = {
        f"model.visual.{name}": t.to(torch.bfloat16).contiguous() for name, t in model.state_dict().items()
    }
    del model
    save_file(tensors, str(directory / "model-00001-of-00001.safetensors"), metadata={"format": "pt"})
    weight_map = dict.fromkeys(tensors, "model-00001-of-00001.safetensors")
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps({"vision_config": REAL_VISION_CONFIG}))
    return time.perf_counter() - start


def real_in_memory_tower(seed: int) -> VisionTower:
    from transformers import Qwen3_5VisionConfig, Qwen3_5VisionModel

    torch.manual_seed(seed)
    return VisionTower.from_module(Qwen3_5VisionModel(Qwen3_5VisionConfig(**REAL_VISION_CONFIG)).float())


def bench_tower(
    tower: VisionTower, prepared: dict[str, Any], reps: int, per_mode_reps: dict[str, int]
) -> dict:
    tower.embed([prepared["g256"]])  # warm-up (threads, allocator)
    out = {}
    for mode, image in prepared.items():
        times, rows = timed(lambda image=image: tower.embed([image]), per_mode_reps.get(mode, reps))
        out[mode] = {**summary(times), "rows": list(rows[0].shape)}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="runs per measurement (decode, preprocess, tiny)")
    parser.add_argument("--real-reps", type=int, default=3, help="runs per mode on the real-width tower")
    parser.add_argument(
        "--real-native-reps", type=int, default=3, help="runs of native mode on the real tower"
    )
    parser.add_argument("--skip-real", action="store_true", help="only the tiny tower")
    parser.add_argument("--real-in-memory", action="store_true", help="build the real tower in memory")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    add_run_arguments(parser, quick="the tiny tower only, 1 run each")
    args = parser.parse_args(argv)
    if args.quick:
        args.skip_real, args.reps = True, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    report = start_report("bench_vision", __file__, argv, quick=args.quick)

    jpeg = photo_like_jpeg()
    source = ImageSource(jpeg, "image/jpeg", ("images", 0))
    decode_times, image = timed(lambda: decode_image(source), args.reps)
    result: dict[str, Any] = {
        **report,
        "image": {"size": list(image.size), "format": "JPEG q90", "bytes": len(jpeg)},
        "decode": summary(decode_times),
        "preprocess": {},
        "tower": {},
    }

    prepared = {}
    for mode in MODES:
        preprocess(image, mode)  # first native call builds and caches transformers' processor
        times, prepared[mode] = timed(lambda mode=mode: preprocess(image, mode), args.reps)
        result["preprocess"][mode] = {
            **summary(times),
            "n_tokens": prepared[mode].n_tokens,
            "merged_hw": list(prepared[mode].merged_hw),
            "n_patches": prepared[mode].pixel_values.shape[0],
        }

    from clef_runtime.model.tiny import make_tiny

    with tempfile.TemporaryDirectory() as tmp:
        tiny = VisionTower(make_tiny(Path(tmp) / "tiny", seed=0))
        load_start = time.perf_counter()
        tiny.load()
        result["tower"]["tiny"] = {"load_s": round(time.perf_counter() - load_start, 3)}
        result["tower"]["tiny"].update(bench_tower(tiny, prepared, args.reps, {}))

    if not args.skip_real:
        real_reps = {"native": args.real_native_reps, "g256": args.real_reps, "g448": args.real_reps}
        if args.real_in_memory:
            build_start = time.perf_counter()
            real = real_in_memory_tower(seed=0)
            entry: dict[str, Any] = {"build_s": round(time.perf_counter() - build_start, 2)}
            entry.update(bench_tower(real, prepared, args.real_reps, real_reps))
        else:
            with tempfile.TemporaryDirectory() as tmp:
                write_s = write_real_checkpoint(Path(tmp), seed=0)
                real = VisionTower(tmp)
                load_start = time.perf_counter()
                real.load()
                entry = {"write_s": round(write_s, 2), "load_s": round(time.perf_counter() - load_start, 2)}
                entry.update(bench_tower(real, prepared, args.real_reps, real_reps))
        entry["params"] = sum(p.numel() for p in real.load().parameters())
        result["tower"]["real"] = entry
        real.unload()

    totals = {}
    for tower_name, entry in result["tower"].items():
        totals[tower_name] = {
            mode: round(
                result["decode"]["median_ms"]
                + result["preprocess"][mode]["median_ms"]
                + entry[mode]["median_ms"],
                1,
            )
            for mode in MODES
        }
    result["total_per_image_ms"] = totals
    return publish(result, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
