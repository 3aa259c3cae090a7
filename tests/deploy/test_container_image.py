"""The CPU image (deploy/Containerfile), built and run here for real: podman as root with runc, a Debian
bookworm base made with debootstrap (no registry is reachable), torch's CPU wheel from the folder pip's
configuration names. The build is README's command; podman's layer cache keeps a rebuild after a source
change to the last layers (seconds), so the suite pays the full build once per machine."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from devtools.containers import (
    ULIMITS,
    build_command,
    debian_base_image,
    ensure_podman,
    podman,
    wheels_folder,
)
from devtools.harness import REPO, free_port

from clef_runtime.model.resolve import resolve_model

pytestmark = pytest.mark.slow

TAG = "localhost/clef-runtime:cpu-test"
DECISION = {"state": "The parcel arrived broken.", "questions": {"refund": {"type": "noul"}}}


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> str:
    ensure_podman()
    base = debian_base_image()
    wheels = wheels_folder(tmp_path_factory.mktemp("no-wheels"))
    # Docker's image format keeps HEALTHCHECK (OCI's has no field for it); the command itself is README's.
    environment = {**os.environ, "BUILDAH_FORMAT": "docker"}
    with open(Path(tempfile.gettempdir()) / "clef-tests-image.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        built = subprocess.run(
            build_command(base, wheels, TAG),
            cwd=REPO,
            env=environment,
            capture_output=True,
            text=True,
            timeout=1800,
        )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return TAG


def _wait_ready(url: str, container: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    logs = podman("logs", container, check=False)
    raise AssertionError(
        f"{container} not ready within {timeout} s:\n{logs.stdout[-3000:]}{logs.stderr[-3000:]}"
    )


@pytest.fixture
def container_name() -> Iterator[str]:
    name = f"clef-test-{uuid.uuid4().hex[:12]}"
    yield name
    podman("rm", "--force", "--volumes", "--time", "5", name, check=False)


def test_the_image_serves_as_a_non_root_user_and_stops_cleanly_on_sigterm(
    image: str, container_name: str
) -> None:
    port = free_port()
    podman(
        "run", "-d", "--name", container_name, "--network=host", *ULIMITS,
        "-e", "CLEF_HOST=127.0.0.1", "-e", f"CLEF_PORT={port}", image,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    _wait_ready(url, container_name)
    answer = httpx.post(url + "/v1/systemone", json=DECISION, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "tiny" and answer.json()["answers"]["refund"]["type"] == "noul"
    # The server is the container's first process, and it runs as the image's user, not root.
    status = podman("exec", container_name, "cat", "/proc/1/status").stdout
    uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
    assert uid_line.split()[1:] == ["10001"] * 4
    assert "clef serve" in podman("exec", container_name, "cat", "/proc/1/cmdline").stdout.replace("\0", " ")
    described = json.loads(podman("image", "inspect", image).stdout)[0]
    assert described["Healthcheck"]["Test"] == ["CMD", "python", "-m", "clef_runtime.probe"]
    assert described["Config"]["User"] == "clef"
    assert podman("healthcheck", "run", container_name, check=False).returncode == 0
    podman("stop", "--time", "60", container_name)
    assert podman("inspect", "--format", "{{.State.ExitCode}}", container_name).stdout.strip() == "0"
    logs = podman("logs", container_name)
    assert "clef_runtime.server: stopped" in logs.stdout + logs.stderr


def test_the_images_default_address_needs_a_key(image: str) -> None:
    # The image binds every interface (a container is reached from outside): without a key it must refuse.
    refused = podman(
        "run", "--rm", "--network=host", *ULIMITS, "-e", f"CLEF_PORT={free_port()}", image, check=False
    )  # fmt: skip
    assert refused.returncode == 2, refused.stderr
    assert "--api-key" in refused.stderr and "--allow-unauthenticated" in refused.stderr


def test_compose_serves_a_mounted_model_with_its_key_from_a_secret(image: str, tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    release = resolve_model("tiny").path
    subprocess.run(["cp", "-r", str(release), str(models / "clef-flash")], check=True)
    subprocess.run(["chmod", "-R", "a+rX", str(tmp_path)], check=True)
    secret = tmp_path / "api-key.txt"
    secret.write_text("compose-secret-key\n", encoding="utf-8")
    secret.chmod(0o644)
    # This machine's podman needs runc and lowered limits; the compose file stays as users run it.
    (tmp_path / "containers.conf").write_text('[engine]\nruntime = "runc"\n', encoding="utf-8")
    override = tmp_path / "this-machine.yaml"
    override.write_text(
        "services:\n  clef:\n    ulimits:\n      nofile: {soft: 1024, hard: 1024}\n"
        "      nproc: {soft: 1024, hard: 1024}\n",
        encoding="utf-8",
    )
    port = free_port()
    environment = {
        **{key: value for key, value in os.environ.items() if not key.startswith("CLEF_")},
        "CONTAINERS_CONF": str(tmp_path / "containers.conf"),
        "CLEF_IMAGE": image,
        "CLEF_MODELS_DIR": str(models),
        "CLEF_API_KEY_PATH": str(secret),
        "CLEF_HOST_PORT": str(port),
    }
    project = f"cleftest{uuid.uuid4().hex[:8]}"
    compose = ["podman-compose", "-p", project, "-f", "deploy/compose.yaml", "-f", str(override)]

    def run(*arguments: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*compose, *arguments], cwd=REPO, env=environment, capture_output=True, text=True, timeout=300
        )

    try:
        up = run("up", "-d", "--no-build")
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, f"{project}_clef_1")
        models_answer = httpx.get(url + "/v1/models", headers={"authorization": "Bearer compose-secret-key"})
        assert models_answer.status_code == 200
        assert [model["id"] for model in models_answer.json()["data"]] == ["clef-flash"]
        assert httpx.get(url + "/v1/models").status_code == 401
    finally:
        down = run("down", "-v")
    assert down.returncode == 0, down.stderr[-3000:]
