"""What the server-level benchmarks share: the hidden-512 / 8-layer "medium" random checkpoint (the model
issue 11's batching and warm-path targets and the growing-state benchmark are stated for; `engine_bench.py`'s
medium is a different, hidden-1,024 model) and starting / stopping a real ``clef serve`` process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]

WORDS = ["charged", "twice", "refund", "order", "invoice", "march", "please", "today", "bank", "dispute"]


def make_medium(directory: Path) -> Path:
    """A random "medium" checkpoint in the release layout: the tiny recipe at hidden 512, 8 layers (6 Gated
    DeltaNet + 2 attention), head width 128 (~0.3 B parameters with the full vocabulary tables)."""
    from clef_runtime.model import tiny

    original_config, original_head = tiny.tiny_config, dict(tiny.TINY_HEAD_CONFIG)

    def medium_config(seed: int = 0) -> dict[str, Any]:
        config = original_config(seed)
        text = config["text_config"]
        text.update(
            hidden_size=512,
            intermediate_size=1536,
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=64,
            linear_num_key_heads=4,
            linear_num_value_heads=8,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
        )
        config["vision_config"]["out_hidden_size"] = 512
        config["clef_runtime"]["medium"] = True
        return config

    tiny.tiny_config = medium_config  # type: ignore[assignment]
    tiny.TINY_HEAD_CONFIG = {
        "hidden_size": 512,
        "width": 128,
        "routing_layers": 2,
        "layers": 2,
        "heads": 4,
        "feedforward": 256,
    }  # type: ignore[assignment]
    try:
        return tiny.make_tiny(directory)
    finally:
        tiny.tiny_config = original_config  # type: ignore[assignment]
        tiny.TINY_HEAD_CONFIG = original_head  # type: ignore[assignment]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(
    command: list[str], port: int, log_path: Path, timeout: float = 600
) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLEF_")}
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"server exited {process.returncode}: {log_path.read_text()[-2000:]}")
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError("server did not become ready")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.2)


def stop_server(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(120)
    except subprocess.TimeoutExpired:
        process.kill()
