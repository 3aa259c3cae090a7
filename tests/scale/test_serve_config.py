"""deploy/ray-serve.yaml as Ray users run it: ``serve run`` with the committed config, from the repository
root, on a local Ray head bound to 127.0.0.1 (one cluster for the module; every Ray process stopped after),
and ``app_builder`` reading the options the config leaves out from ``CLEF_*`` variables."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from clef_runtime.scale import ray_serve
from clef_runtime.scale.settings import RaySettings
from clef_runtime.server.settings import ServerSettings, SettingsError
from tests.scale.test_ray_serve import RayServer, decide, one_ray_cluster_at_a_time, ray_processes
from tests.server.conftest import free_port

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "deploy" / "ray-serve.yaml"
# `serve run`, Ray's own command, in a process that started a local Ray head on 127.0.0.1 first (`ray start`
# binds the machine's address instead, even when told 127.0.0.1): `serve run` then uses that Ray, and the
# head stops, with every process it started, when `serve run` exits on Ctrl-C.
SERVE_RUN_ON_LOOPBACK = (
    "import sys, ray; from ray.serve.scripts import cli; "
    "ray.init(_node_ip_address='127.0.0.1', include_dashboard=False, num_cpus=int(sys.argv[1])); "
    "cli.main(sys.argv[2:], prog_name='serve')"
)


def config_on_port(directory: Path, port: int) -> Path:
    """A copy of the committed config with only its HTTP port changed (8000 may be taken on this machine)."""
    config = yaml.safe_load(CONFIG.read_text(encoding="utf-8"))
    config["http_options"]["port"] = port
    copy = directory / "ray-serve.yaml"
    copy.write_text(yaml.safe_dump(config), encoding="utf-8")
    return copy


def wait_until_ready(server: RayServer, replicas: int) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert server.process.poll() is None, server.log_text()[-4000:]
        try:
            ready = httpx.get(server.url + "/ready", timeout=5)
            if ready.status_code == 200 and ready.json()["replicas"]["up"] == replicas:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise AssertionError(f"not ready within 300 s:\n{server.log_text()[-4000:]}")


@pytest.fixture(scope="module")
def serve_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayServer]:
    with one_ray_cluster_at_a_time():
        assert not ray_processes(), "Ray is already running on this machine"
        directory = tmp_path_factory.mktemp("serve-config")
        http_port = free_port()
        env = {
            **os.environ,
            # The worktree's package first (the Ray workers inherit this from the head), then tests/.
            "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]),
            "RAY_USAGE_STATS_ENABLED": "0",
            "XDG_DATA_HOME": str(directory / "data"),  # the ingress's jobs database
        }
        env.pop("RAY_ADDRESS", None)
        log = directory / "serve.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                [
                    *(sys.executable, "-c", SERVE_RUN_ON_LOOPBACK, str(max(2, os.cpu_count() or 1))),
                    *("run", str(config_on_port(directory, http_port))),
                ],
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C from the test reaches `serve run` only
            )
        try:
            server = RayServer(process, f"http://127.0.0.1:{http_port}", log)
            wait_until_ready(server, replicas=2)
            yield server
        finally:
            process.send_signal(signal.SIGINT)  # `serve run` shuts Serve down on Ctrl-C
            try:
                process.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)


@pytest.mark.slow
def test_serve_run_serves_the_committed_config(serve_run: RayServer) -> None:
    # The replicas of the config's args are up: /ready counted the deployment's two.
    models = httpx.get(serve_run.url + "/v1/models", timeout=30)
    assert models.status_code == 200, models.text
    assert [model["id"] for model in models.json()["data"]] == ["tiny"]
    decision = decide(serve_run.url, "A customer asks where their parcel is.", "late")
    assert list(decision.json()["answers"]) == ["late"]
    # State affinity: one state's questions go to the replica that holds it, from its state cache.
    state = "The order arrived without its invoice and the customer asks for one by e-mail. " * 4
    responses = [decide(serve_run.url, state, f"q{number}") for number in range(4)]
    assert len({response.headers["x-clef-replica"] for response in responses}) == 1
    assert [response.headers["x-clef-state-cache"] for response in responses] == ["miss", "hit", "hit", "hit"]
    ready = httpx.get(serve_run.url + "/ready", timeout=30).json()
    assert ready["replicas"] == {"up": 2, "target": 2}


@pytest.mark.slow
def test_ctrl_c_leaves_no_ray_process(serve_run: RayServer) -> None:
    # Runs last in this module: stops what the fixture started, as a user would.
    serve_run.process.send_signal(signal.SIGINT)
    serve_run.process.wait(120)
    deadline = time.monotonic() + 60
    while ray_processes():
        assert time.monotonic() < deadline, ray_processes()
        time.sleep(1)
    assert "Traceback" not in serve_run.log_text()[-4000:], serve_run.log_text()[-4000:]


def test_app_builder_reads_the_options_args_leave_out_from_clef_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built: list[tuple[ServerSettings, RaySettings]] = []
    monkeypatch.setattr(ray_serve, "build_application", lambda settings, ray: built.append((settings, ray)))
    monkeypatch.setenv("CLEF_MODEL", "tiny")
    monkeypatch.setenv("CLEF_API_KEY", "from-a-secret")
    monkeypatch.setenv("CLEF_CACHE_MB", "512")
    monkeypatch.setenv("CLEF_REPLICAS", "3")
    monkeypatch.setenv("CLEF_RAY_ADDRESS", "ray://elsewhere:10001")  # not the builder's business
    ray_serve.app_builder({"cache_mb": 1024})
    ((settings, ray),) = built
    assert (settings.model, settings.api_keys) == ("tiny", ("from-a-secret",))
    assert settings.engine.cache_mb == 1024  # an arg beats its variable
    assert (ray.ray, ray.replicas, ray.ray_address) == (True, 3, None)
    monkeypatch.setenv("CLEF_REPLICAS", "three")
    with pytest.raises(SettingsError, match="CLEF_REPLICAS"):
        ray_serve.app_builder({})
    monkeypatch.delenv("CLEF_MODEL")
    monkeypatch.delenv("CLEF_REPLICAS")
    with pytest.raises(SettingsError, match=r"args\.model is required"):
        ray_serve.app_builder({})
