"""resolve_model: tiny (built once, atomically), local directories, Hugging Face repo ids (offline cache);
model_identity: the same weights under every spelling of their spec, without resolving it."""

from __future__ import annotations

import fnmatch
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import clef_runtime.model.resolve as resolve_module
import clef_runtime.model.tiny as tiny_module
from clef_runtime.model.checkpoint import (
    CLEF_27B,
    CLEF_FLASH,
    KNOWN_RELEASES,
    PINNED_FILE_SIZES,
    PINNED_REPO_ID,
    PINNED_REVISION,
    RELEASE_FILE_PATTERNS,
    TINY_DESCRIPTION,
    CheckpointError,
    ModelCard,
    known_release,
    model_card,
    verify_checkpoint,
)
from clef_runtime.model.resolve import (
    ModelResolutionError,
    ResolvedModel,
    model_identity,
    resolve_model,
    tiny_cache_path,
)

REVISION = "0123456789abcdef0123456789abcdef01234567"
CLEF_27B_REVISION = "2f3de3dd85f379784083b0814d997ab627200f0c"


@pytest.fixture
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tokenizer_json_path: Path) -> Path:
    """A fresh clef-runtime cache dir; the tiny builder reuses the session's tokenizer (no rebuild)."""
    cache = tmp_path / "clef-cache"
    monkeypatch.setenv("CLEF_CACHE_DIR", str(cache))
    monkeypatch.setattr(tiny_module, "_default_tokenizer_path", lambda: tokenizer_json_path)
    return cache


def _hf_cache(root: Path, repo_id: str, revision: str, source: Path, *, ref: str | None = "main") -> Path:
    """Lay out ``models--Org--name/snapshots/<revision>/`` (+ ``refs/<ref>``) as huggingface_hub writes it."""
    repo_dir = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for entry in source.iterdir():
        (snapshot / entry.name).symlink_to(entry)
    if ref is not None:
        (repo_dir / "refs").mkdir()
        (repo_dir / "refs" / ref).write_text(revision)
    return snapshot


@pytest.fixture
def offline_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    hub = tmp_path / "hub"
    hub.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub


def test_tiny_is_built_once_even_by_concurrent_callers(
    private_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_make_tiny = tiny_module.make_tiny
    both_building = threading.Barrier(2, timeout=60)
    builds: list[Path] = []

    def racing_make_tiny(directory: Path, seed: int = 0) -> Path:
        both_building.wait()  # both callers are past the "already built?" check and build at the same time
        builds.append(Path(directory))
        return real_make_tiny(directory, seed)

    monkeypatch.setattr(tiny_module, "make_tiny", racing_make_tiny)
    results: list[ResolvedModel] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            results.append(resolve_model("tiny"))
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(builds) == 2
    # Concurrent transformers constructions must not leave process-wide torch state changed.
    assert torch.get_default_dtype() == torch.float32
    assert results[0] == results[1]
    resolved = results[0]
    assert resolved.is_tiny and resolved.name == "tiny" and resolved.revision is None
    assert resolved.path.parent == private_cache
    assert resolved.path.name.startswith("tiny-")
    assert verify_checkpoint(resolved.path).is_tiny
    # The losing builder's staging directory is gone; only the final checkpoint remains.
    assert [entry.name for entry in private_cache.iterdir() if entry.name.startswith((".tiny", "tiny"))] == [
        resolved.path.name
    ]

    def must_not_build(directory: Path, seed: int = 0) -> Path:
        raise AssertionError("the cached tiny checkpoint should be reused")

    monkeypatch.setattr(tiny_module, "make_tiny", must_not_build)
    assert resolve_model("tiny") == resolved


def test_local_directory(tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    resolved = resolve_model(str(tiny_dir))
    assert resolved.path == tiny_dir.resolve()
    assert resolved.is_tiny
    assert resolved.revision is None
    assert resolved.expected_sizes is None
    monkeypatch.chdir(tiny_dir.parent)
    assert resolve_model(f"./{tiny_dir.name}").path == tiny_dir.resolve()
    plain = tmp_path / "plain"
    plain.mkdir()
    assert resolve_model(str(plain)).is_tiny is False


@pytest.mark.parametrize("spec", ["", "./not/there", "/not/there/either", "a/b/c", "org/na me", "justaname"])
def test_unusable_specs(spec: str, offline_hub: Path) -> None:
    with pytest.raises(ModelResolutionError) as error:
        resolve_model(spec)
    assert isinstance(error.value, CheckpointError)


def test_offline_cache_by_branch(offline_hub: Path, tiny_dir: Path) -> None:
    snapshot = _hf_cache(offline_hub, "Org/tiny-clef", REVISION, tiny_dir)
    resolved = resolve_model("Org/tiny-clef")
    assert resolved.path == snapshot
    assert (resolved.name, resolved.revision, resolved.is_tiny) == ("Org/tiny-clef", "main", True)
    assert resolved.expected_sizes is None
    assert verify_checkpoint(resolved.path).tensor_count > 0


def test_offline_cache_by_commit(offline_hub: Path, tiny_dir: Path) -> None:
    snapshot = _hf_cache(offline_hub, "Org/tiny-clef", REVISION, tiny_dir, ref=None)
    resolved = resolve_model(f"Org/tiny-clef@{REVISION}")
    assert resolved.path == snapshot
    assert resolved.revision == REVISION


def test_pinned_release_defaults_to_the_pinned_revision(offline_hub: Path, tiny_dir: Path) -> None:
    # A cache holding other files under the pinned commit: resolution works, the published sizes do not match.
    snapshot = _hf_cache(offline_hub, "Cloudflare/clef-flash", PINNED_REVISION, tiny_dir, ref=None)
    resolved = resolve_model("Cloudflare/clef-flash")
    assert resolved.path == snapshot
    assert resolved.revision == PINNED_REVISION
    assert resolved.expected_sizes == PINNED_FILE_SIZES
    with pytest.raises(CheckpointError, match="published sizes"):
        verify_checkpoint(resolved.path, expected_sizes=resolved.expected_sizes)


def test_the_known_releases() -> None:
    # Clef-flash keeps its names; the 27B Clef is pinned too, with no published file sizes (none invented).
    assert (CLEF_FLASH.repo_id, CLEF_FLASH.revision) == (PINNED_REPO_ID, PINNED_REVISION)
    assert PINNED_REPO_ID == "Cloudflare/clef-flash"
    assert CLEF_FLASH.file_sizes is PINNED_FILE_SIZES
    assert (CLEF_27B.repo_id, CLEF_27B.revision, CLEF_27B.file_sizes) == (
        "Cloudflare/clef",
        CLEF_27B_REVISION,
        None,
    )
    assert set(KNOWN_RELEASES) == {"cloudflare/clef-flash", "cloudflare/clef"}
    assert known_release(" CLOUDFLARE/Clef ") is CLEF_27B
    assert known_release("cloudflare/clef-flash") is CLEF_FLASH
    for other in ("Cloudflare/clef-fla", "Cloudflare/clef-27b", "Other/clef", "Cloudflare/clef@main"):
        assert known_release(other) is None, other


def test_the_model_card_is_decided_by_the_release() -> None:
    # /v1/models: Clef-flash's date is published, the 27B's is not (unknown, not the 9B's); a release under
    # any other name (a local directory) is taken for Clef-flash; the tiny checkpoint says it is untrained.
    assert model_card("cloudflare/CLEF-flash", untrained=False) == ModelCard(
        "cloudflare/CLEF-flash", "cloudflare/CLEF-flash: Cloudflare's Clef decision model", "2026-10-01"
    )
    assert model_card("Cloudflare/clef", untrained=False).release_date is None
    assert model_card("my-release-dir", untrained=False).release_date == CLEF_FLASH.release_date
    assert model_card("tiny", untrained=True) == ModelCard("tiny", TINY_DESCRIPTION, "2026-11-29", True)


def test_the_27b_release_defaults_to_its_pinned_revision(offline_hub: Path, tiny_dir: Path) -> None:
    snapshot = _hf_cache(offline_hub, "Cloudflare/clef", CLEF_27B_REVISION, tiny_dir, ref=None)
    for spelling in ("Cloudflare/clef", f"Cloudflare/clef@{CLEF_27B_REVISION}"):
        resolved = resolve_model(spelling)
        assert resolved.path == snapshot, spelling
        assert resolved.revision == CLEF_27B_REVISION
        # No published sizes: nothing to check them against, and the layout checks still run.
        assert resolved.expected_sizes is None
        assert verify_checkpoint(resolved.path, expected_sizes=resolved.expected_sizes).tensor_count > 0
    other = _hf_cache(offline_hub, "Cloudflare/clef", REVISION, tiny_dir, ref=None)
    resolved = resolve_model(f"Cloudflare/clef@{REVISION}")
    assert (resolved.path, resolved.revision, resolved.expected_sizes) == (other, REVISION, None)
    # Clef-flash still gets its own revision and published sizes.
    with pytest.raises(ModelResolutionError, match=f"Cloudflare/clef-flash@{PINNED_REVISION}"):
        resolve_model("Cloudflare/clef-flash")


def test_the_27b_release_not_cached_offline_says_how_to_download_its_pinned_revision(
    offline_hub: Path,
) -> None:
    with pytest.raises(ModelResolutionError) as error:
        resolve_model("Cloudflare/clef")
    message = str(error.value)
    assert f"Cloudflare/clef@{CLEF_27B_REVISION} is not in the local Hugging Face cache" in message
    assert f"hf download Cloudflare/clef --revision {CLEF_27B_REVISION}" in message


def _online_hub(monkeypatch: pytest.MonkeyPatch, snapshot: Path) -> list[dict[str, Any]]:
    """Make the Hub "answer" and every download return ``snapshot``; returns the list the download calls go
    to."""
    calls: list[dict[str, Any]] = []

    def fake_snapshot_download(repo_id: str, **kwargs: Any) -> str:
        calls.append({"repo_id": repo_id, **kwargs})
        return str(snapshot)

    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.setattr(resolve_module, "_hub_unreachable", lambda endpoint: None)
    return calls


def test_the_27b_release_downloads_its_pinned_revision_and_only_the_release_files(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _online_hub(monkeypatch, tiny_dir)
    resolved = resolve_model("Cloudflare/clef")
    (call,) = calls
    assert (call["repo_id"], call["revision"]) == ("Cloudflare/clef", CLEF_27B_REVISION)
    assert call["allow_patterns"] == list(RELEASE_FILE_PATTERNS) and "*.py" in call["ignore_patterns"]
    assert (resolved.name, resolved.revision, resolved.expected_sizes) == (
        "Cloudflare/clef",
        CLEF_27B_REVISION,
        None,
    )


def test_not_cached_offline_says_how_to_download(offline_hub: Path, tiny_dir: Path) -> None:
    with pytest.raises(ModelResolutionError) as error:
        resolve_model("Cloudflare/clef-flash")
    message = str(error.value)
    assert f"Cloudflare/clef-flash@{PINNED_REVISION}" in message
    assert "HF_HUB_OFFLINE" in message
    assert f"hf download Cloudflare/clef-flash --revision {PINNED_REVISION}" in message

    _hf_cache(offline_hub, "Org/tiny-clef", REVISION, tiny_dir)
    with pytest.raises(ModelResolutionError, match="Org/tiny-clef@v2 is not in the local Hugging Face cache"):
        resolve_model("Org/tiny-clef@v2")


def test_online_download_fetches_only_release_files(monkeypatch: pytest.MonkeyPatch, tiny_dir: Path) -> None:
    calls = _online_hub(monkeypatch, tiny_dir)
    resolved = resolve_model("Cloudflare/clef-flash")
    assert resolved.path == tiny_dir
    (call,) = calls
    assert call["repo_id"] == "Cloudflare/clef-flash"
    assert call["revision"] == PINNED_REVISION
    assert call["local_files_only"] is False
    patterns = call["allow_patterns"]
    release = [
        "config.json",
        "model-00001-of-00004.safetensors",
        "model-00004-of-00004.safetensors",
        "model.safetensors.index.json",
        "joint_head.safetensors",
        "joint_head_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "processor_config.json",
    ]
    ignored = ["joint_schema_model.py", "generation_config.json", "chat_template.jinja", "README.md"]
    assert all(any(fnmatch.fnmatch(name, p) for p in patterns) for name in release)
    assert not any(any(fnmatch.fnmatch(name, p) for p in patterns) for name in ignored)
    assert "*.py" in call["ignore_patterns"]
    assert patterns == list(RELEASE_FILE_PATTERNS)

    resolve_model("Other/model")
    assert calls[-1]["revision"] == "main"
    assert resolve_module.PINNED_REVISION == PINNED_REVISION


HUB_PROBE = """
import sys
from clef_runtime.model.resolve import ModelResolutionError, resolve_model
try:
    print(resolve_model(sys.argv[1]).path)
except ModelResolutionError as error:
    print(error)
"""


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # closed again when the block ends: connections are refused


def _resolve_without_network(spec: str, hub: Path) -> subprocess.CompletedProcess[str]:
    # A fresh process: huggingface_hub reads HF_ENDPOINT at import. Nothing leaves the machine.
    env = {
        **os.environ,
        "HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}",
        "HF_HUB_CACHE": str(hub),
        "HF_HUB_OFFLINE": "0",
    }
    return subprocess.run(
        [sys.executable, "-c", HUB_PROBE, spec],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_an_unreachable_hub_fails_at_once_with_one_message_saying_what_to_do(tmp_path: Path) -> None:
    done = _resolve_without_network("Cloudflare/clef-flash", tmp_path / "hub")
    assert done.returncode == 0, done.stderr
    # No retry warnings (huggingface_hub retries an unreachable Hub five times, ~25 s), no traceback.
    assert "Retry" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    (message,) = done.stdout.strip().splitlines()
    assert "cannot be reached" in message
    assert f"hf download Cloudflare/clef-flash --revision {PINNED_REVISION}" in message
    assert "HF_HUB_OFFLINE=1" in message and "--model DIR" in message


def test_an_unreachable_hub_still_loads_a_cached_copy(tmp_path: Path, tiny_dir: Path) -> None:
    snapshot = _hf_cache(tmp_path / "hub", "Org/tiny-clef", REVISION, tiny_dir)
    done = _resolve_without_network("Org/tiny-clef", tmp_path / "hub")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(snapshot)


def test_every_spelling_of_a_repo_id_has_one_identity_with_the_revision_it_loads(
    offline_hub: Path, tiny_dir: Path
) -> None:
    pinned = model_identity(PINNED_REPO_ID)
    assert pinned.ref == f"cloudflare/clef-flash@{PINNED_REVISION}" and pinned.name == PINNED_REPO_ID
    for spelling in (
        "cloudflare/clef-flash",
        " Cloudflare/Clef-Flash ",
        f"CLOUDFLARE/clef-flash@{PINNED_REVISION}",
    ):
        assert model_identity(spelling).ref == pinned.ref, spelling
    assert model_identity("cloudflare/clef-flash@main").ref != pinned.ref  # other weights
    # The revision is the one resolve_model loads; nothing is fetched to name it (the cache is empty).
    assert model_identity("Org/not-cached").ref == "org/not-cached@main"
    _hf_cache(offline_hub, "Org/tiny-clef", REVISION, tiny_dir)
    assert model_identity("Org/Tiny-Clef").ref == f"org/tiny-clef@{resolve_model('Org/tiny-clef').revision}"


def test_the_27b_release_has_its_own_identity_with_its_pinned_revision() -> None:
    clef = model_identity("Cloudflare/clef")
    assert clef.ref == f"cloudflare/clef@{CLEF_27B_REVISION}" and clef.name == "Cloudflare/clef"
    for spelling in ("cloudflare/clef", " CLOUDFLARE/Clef ", f"Cloudflare/clef@{CLEF_27B_REVISION}"):
        assert model_identity(spelling).ref == clef.ref, spelling
    assert model_identity("Cloudflare/clef@main").ref != clef.ref  # other weights
    assert model_identity(PINNED_REPO_ID).ref != clef.ref  # Clef-flash is another model


def test_a_local_directory_is_identified_by_its_resolved_path_and_tiny_by_its_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "models" / "my-model"
    directory.mkdir(parents=True)
    (tmp_path / "alias").symlink_to(directory)
    monkeypatch.chdir(tmp_path)
    for spelling in (str(directory), "models/my-model", "./alias"):
        assert model_identity(spelling).ref == str(directory.resolve()), spelling
    assert model_identity("alias").name == "my-model"
    assert model_identity("tiny").ref == tiny_cache_path().name
    assert model_identity("fake").ref == "fake"  # not a repo id: stands for itself
