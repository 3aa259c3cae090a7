"""The wheels a device machine needs, derived: the distributions the server, the engine and the GPU check
import (in a fresh interpreter) that clef-runtime requires, minus what the device image's manifest
(image-manifest.toml) already holds at a version every requirement accepts, plus the fused DeltaNet kernels'
package. Each carried package's version is this environment's, or the newest older one inside pyproject's
range whose Requires-Dist (and, for transformers, the versions it checks at import) fits the image and the
rest of the carry list.

    python -m benchmarks.device.closure [--python-version X.Y]            print the carry list
    python -m benchmarks.device.closure --wheels OUTDIR [--python-version X.Y]   download it (needs PyPI)

Exit status 1 when the carry list cannot install together on the image, 2 for bad arguments."""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = Path(__file__).with_name("image-manifest.toml")
# What the one device command runs: the server (`clef serve`, whose MCP endpoint imports the SDK at start),
# the engine and the check. clef_runtime.server.mcp.http is named although the app imports it today, so that a
# lazier app cannot silently drop the MCP SDK from the list.
ROOT_MODULES = (
    "clef_runtime.cli",
    "clef_runtime.server.app",
    "clef_runtime.server.mcp.http",
    "clef_runtime.engine.clef",
    "benchmarks.gpu_check",
)
# What `clef serve` imports only when it starts (serve_command.py imports uvicorn inside its function).
START_TIME_IMPORTS = ("uvicorn",)
OWN_DISTRIBUTION = "clef-runtime"
# The fused Gated DeltaNet kernels (model/fused.py) are imported on CUDA only, so the CPU closure cannot see
# them: pyproject's `cuda` extra names the package whose Triton kernels compile on the device.
FUSED_EXTRA = "cuda"
FUSED_PACKAGE = "flash-linear-attention"
# causal-conv1d builds a CUDA extension: it is never carried as a wheel.
BUILT_ON_DEVICE = frozenset({"causal-conv1d"})
# transformers checks these at import (transformers/dependency_versions_check.py), against its own table.
TRANSFORMERS_CHECK = "transformers/dependency_versions_check.py"
TRANSFORMERS_TABLE = "transformers/dependency_versions_table.py"
PLATFORMS = (
    *(f"manylinux_2_{n}_x86_64" for n in (39, 35, 34, 31, 28, 27, 24, 17)),
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
    "any",
)


@dataclass(frozen=True)
class Manifest:
    """The device image: its Python, the versions it holds, those never shadowed and those it lacks."""

    python: str
    present: Mapping[str, Version]
    keep: frozenset[str]
    absent: frozenset[str]


def load_manifest(path: Path = MANIFEST) -> Manifest:
    """Reads image-manifest.toml; a name both present and absent, or kept but not present, is an error."""
    data = tomllib.loads(path.read_text())
    present: dict[str, Version] = {
        canonicalize_name(name): Version(version) for name, version in data["present"].items()
    }
    keep = frozenset(canonicalize_name(name) for name in data.get("keep", []))
    absent = frozenset(canonicalize_name(name) for name in data.get("absent", []))
    if both := absent & present.keys():
        raise ValueError(f"{path}: listed both present and absent: {sorted(both)}")
    if unknown := keep - present.keys():
        raise ValueError(f"{path}: kept but not present: {sorted(unknown)}")
    return Manifest(python=str(data["python"]), present=present, keep=keep, absent=absent)


def marker_environment(python_version: str) -> dict[str, str]:
    """PEP 508 marker values of the device: CPython X.Y on Linux x86_64."""
    return {
        "python_version": python_version,
        "python_full_version": f"{python_version}.0",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "extra": "",
    }


def applicable(
    requirements: Iterable[str], python_version: str, extras: Iterable[str] = ()
) -> list[Requirement]:
    """The requirements that hold on the device (markers evaluated), with those of the `extras` asked for."""
    environments = [{**marker_environment(python_version), "extra": e} for e in ("", *extras)]
    parsed = (Requirement(text) for text in requirements)
    return [r for r in parsed if r.marker is None or any(r.marker.evaluate(env) for env in environments)]


def our_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[str]:
    """clef-runtime's own dependency specifiers, as pyproject states them."""
    return list(tomllib.loads(pyproject.read_text())["project"]["dependencies"])


def fused_requirement(pyproject: Path = ROOT / "pyproject.toml") -> Requirement:
    """flash-linear-attention's range, from pyproject's `cuda` extra."""
    extra = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"][FUSED_EXTRA]
    found = [
        Requirement(text) for text in extra if canonicalize_name(Requirement(text).name) == FUSED_PACKAGE
    ]
    return found[0]


# The packages whose imports make the closure's roots: ours.
OWN_PACKAGES = ("clef_runtime", "benchmarks")
# Run in a fresh interpreter: records the top-level modules that our own modules import (every import
# statement, whether or not the module was loaded already), then imports the roots.
_RECORD_IMPORTS = """
import builtins, importlib, json, sys
own, imported, original = set(sys.argv[1].split(",")), set(), builtins.__import__
def recording(name, globals=None, locals=None, fromlist=(), level=0):
    importer = (globals or {}).get("__name__") or ""
    if level == 0 and importer.split(".")[0] in own:
        imported.add(name.split(".")[0])
    return original(name, globals, locals, fromlist, level)
builtins.__import__ = recording
for root in sys.argv[2:]:
    importlib.import_module(root)
print(json.dumps(sorted(imported - set(sys.stdlib_module_names) - own)))
"""


def imported_top_modules(modules: Iterable[str] = ROOT_MODULES) -> set[str]:
    """The top-level non-stdlib modules our own code imports while `modules` are imported in a fresh
    interpreter (what a third party imports in turn is its Requires-Dist's business, checked in resolve)."""
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", _RECORD_IMPORTS, ",".join(OWN_PACKAGES), *modules],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path},
        check=True,
    )
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def imported_distributions(modules: Iterable[str]) -> set[str]:
    """The installed distributions that provide `modules`, ours left out."""
    providers = importlib.metadata.packages_distributions()
    names: set[str] = {canonicalize_name(d) for module in modules for d in providers.get(module, [])}
    return names - {OWN_DISTRIBUTION}


def import_closure(modules: Iterable[str] = ROOT_MODULES) -> set[str]:
    """The distributions our code imports when the roots load. An import only a third party makes is either
    in its Requires-Dist (carried with it by resolve) or an optional one it guards (uvicorn's watchfiles,
    transformers' scipy), which the emulated image (emulate.sh) shows the device does without."""
    return imported_distributions(imported_top_modules(modules) | set(START_TIME_IMPORTS))


class MetadataSource(Protocol):
    """Where candidate versions, their Requires-Dist and their files come from."""

    def versions(self, name: str) -> list[Version]:
        """Candidates, best first."""
        ...

    def requires(self, name: str, version: Version) -> list[str]: ...

    def read_file(self, name: str, version: Version, path: str) -> str | None: ...


class InstalledSource:
    """This environment's distributions only: one candidate, the installed version (no network)."""

    def versions(self, name: str) -> list[Version]:
        try:
            return [Version(importlib.metadata.version(name))]
        except importlib.metadata.PackageNotFoundError:
            return []

    def requires(self, name: str, version: Version) -> list[str]:
        return importlib.metadata.requires(name) or []

    def read_file(self, name: str, version: Version, path: str) -> str | None:
        located = Path(str(importlib.metadata.distribution(name).locate_file(path)))
        return located.read_text() if located.is_file() else None


class IndexSource:
    """The package index through pip: this environment's version first, then older ones, newest first; each
    candidate's wheel for the device's Python is downloaded once into `cache` and read from there."""

    def __init__(self, python_version: str, cache: Path) -> None:
        self.python_version = python_version
        self.cache = cache

    def _pip(self, *arguments: str) -> str:
        command = [sys.executable, "-m", "pip", *arguments]
        return subprocess.run(command, capture_output=True, text=True, check=True).stdout

    def _target(self) -> list[str]:
        platforms = [argument for p in PLATFORMS for argument in ("--platform", p)]
        return ["--python-version", self.python_version, "--implementation", "cp", *platforms]

    def versions(self, name: str) -> list[Version]:
        listed = self._pip("index", "versions", name, "--only-binary=:all:", *self._target())
        match = re.search(r"Available versions: (.*)", listed)
        available = [Version(v) for v in match.group(1).split(", ")] if match else []
        stable = sorted((v for v in available if not v.is_prerelease), reverse=True)
        installed = InstalledSource().versions(name)
        if not installed:
            return stable
        return [*installed, *(v for v in stable if v < installed[0])]

    def wheel(self, name: str, version: Version) -> Path:
        """The candidate's wheel, downloaded on first use."""
        prefix = f"{canonicalize_name(name).replace('-', '_')}-{version}-"
        found = [w for w in self.cache.glob("*.whl") if w.name.lower().startswith(prefix)]
        if not found:
            self._pip("download", "--quiet", "--no-deps", "--only-binary=:all:", *self._target(),
                      "-d", str(self.cache), f"{name}=={version}")  # fmt: skip
            found = [w for w in self.cache.glob("*.whl") if w.name.lower().startswith(prefix)]
        return found[0]

    def requires(self, name: str, version: Version) -> list[str]:
        metadata = self.read_file(name, version, "*.dist-info/METADATA") or ""
        return [
            line.split(":", 1)[1].strip()
            for line in metadata.splitlines()
            if line.startswith("Requires-Dist:")
        ]

    def read_file(self, name: str, version: Version, path: str) -> str | None:
        with zipfile.ZipFile(self.wheel(name, version)) as archive:
            members = [m for m in archive.namelist() if Path(m).match(path)]
            return archive.read(members[0]).decode() if members else None


def import_time_checks(source: MetadataSource, name: str, version: Version) -> tuple[list[str], list[str]]:
    """What a package checks at import beyond its Requires-Dist: transformers' runtime version checks (the
    names in dependency_versions_check.py's list, with the specifiers of its dependency_versions_table.py),
    as (always checked, checked only when installed: the names its loop singles out with `pkg == "..."`)."""
    if name != "transformers":
        return [], []
    check = source.read_file(name, version, TRANSFORMERS_CHECK)
    table = source.read_file(name, version, TRANSFORMERS_TABLE)
    if check is None or table is None:
        return [], []
    checked = _assigned_literal(check, "pkgs_to_check_at_runtime")
    specifiers = _assigned_literal(table, "deps")
    if not isinstance(checked, list) or not isinstance(specifiers, dict):
        raise ValueError(f"transformers {version}: unexpected dependency_versions_check/table")
    when_installed = {
        node.value
        for compare in ast.walk(ast.parse(check))
        if isinstance(compare, ast.Compare)
        for node in compare.comparators
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }
    texts = [(pkg, specifiers[pkg]) for pkg in checked if pkg in specifiers and pkg != "python"]
    return [t for pkg, t in texts if pkg not in when_installed], [
        t for pkg, t in texts if pkg in when_installed
    ]


def _assigned_literal(source_text: str, target: str) -> object:
    """The literal value assigned to `target` at a module's top level."""
    for node in ast.parse(source_text).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == target for t in node.targets):
            return ast.literal_eval(node.value)
    raise ValueError(f"no top-level assignment to {target}")


@dataclass
class Resolution:
    """The carried versions, and why whatever could not be carried does not install together."""

    carried: dict[str, Version] = field(default_factory=dict)
    conflicts: dict[str, list[str]] = field(default_factory=dict)


def resolve(
    needed: Iterable[str],
    constraints: Mapping[str, SpecifierSet],
    manifest: Manifest,
    source: MetadataSource,
) -> Resolution:
    """Which of `needed` the image lacks (or holds at a version a constraint refuses), and at which version
    each is carried: the first candidate whose requirements the image and the carry list satisfy. A
    requirement on a missing package carries it too; one on a newer version of a present package carries
    that package too, unless the manifest keeps it, which rejects the candidate."""
    resolution = Resolution()
    extras: dict[str, set[str]] = {}
    wanted = {canonicalize_name(name): SpecifierSet() for name in needed}
    for name, specifier in constraints.items():
        wanted[canonicalize_name(name)] = wanted.get(canonicalize_name(name), SpecifierSet()) & specifier
    pending = sorted(wanted)
    while pending:
        name = pending.pop(0)
        specifier = wanted[name]
        if name in resolution.carried or name in resolution.conflicts or name in BUILT_ON_DEVICE:
            continue
        held = manifest.present.get(name)
        if held is not None and specifier.contains(held, prereleases=True):
            continue
        reasons: list[str] = []
        for version in (v for v in source.versions(name) if specifier.contains(v, prereleases=True)):
            added = _unmet(source, name, version, extras.get(name, set()), manifest, resolution, reasons)
            if added is not None:
                resolution.carried[name] = version
                for requirement in added:
                    dependency = canonicalize_name(requirement.name)
                    wanted[dependency] = wanted.get(dependency, SpecifierSet()) & requirement.specifier
                    extras.setdefault(dependency, set()).update(requirement.extras)
                    pending.append(dependency)
                break
        else:
            held_text = f"the image has {held}" if held is not None else "the image lacks it"
            resolution.conflicts[name] = reasons or [f"no version matches {specifier or 'any'} ({held_text})"]
    return resolution


def _unmet(
    source: MetadataSource,
    name: str,
    version: Version,
    extras: Iterable[str],
    manifest: Manifest,
    resolution: Resolution,
    reasons: list[str],
) -> list[Requirement] | None:
    """The requirements `name==version` (with `extras`) adds to the carry list, or None (with a reason) when
    it needs a newer version of a kept package or refuses one already carried."""
    always, when_installed = import_time_checks(source, name, version)
    requirements = applicable([*source.requires(name, version), *always], manifest.python, extras)
    optional = {canonicalize_name(r.name) for r in applicable(when_installed, manifest.python)}
    requirements += applicable(when_installed, manifest.python)
    added: list[Requirement] = []
    for requirement in requirements:
        dependency = canonicalize_name(requirement.name)
        carried = resolution.carried.get(dependency)
        held = manifest.present.get(dependency)
        if dependency in optional and carried is None and held is None:
            continue  # checked only where installed
        if carried is not None:
            if not requirement.specifier.contains(carried, prereleases=True):
                reasons.append(f"{name} {version} needs {requirement}, the carry list has {carried}")
                return None
        elif held is not None and not requirement.specifier.contains(held, prereleases=True):
            if dependency in manifest.keep:
                reasons.append(f"{name} {version} needs {requirement}, the image has {held}")
                return None
            added.append(requirement)
        elif held is None:
            added.append(requirement)
    return added


def derive(manifest: Manifest, source: MetadataSource, modules: Iterable[str] = ROOT_MODULES) -> Resolution:
    """The carry list: the import closure, pyproject's specifiers on it, and the fused kernels' package."""
    closure = import_closure(modules)
    ours = applicable(our_requirements(), manifest.python)
    constraints: dict[str, SpecifierSet] = {
        canonicalize_name(r.name): r.specifier for r in ours if canonicalize_name(r.name) in closure
    }
    fused = fused_requirement()
    constraints[canonicalize_name(fused.name)] = fused.specifier
    return resolve(closure, constraints, manifest, source)


def missing_from(carry: Mapping[str, Version], closure: Iterable[str], manifest: Manifest) -> set[str]:
    """The closure's packages that neither the image nor `carry` holds."""
    needed: set[str] = {canonicalize_name(n) for n in closure}
    return needed - manifest.present.keys() - {canonicalize_name(n) for n in carry}


def download(resolution: Resolution, source: IndexSource, out: Path) -> list[Path]:
    """Copies each carried wheel into `out`; the fused package's must be pure Python (its kernels are Triton
    source compiled on the device), or nothing is left there."""
    wheels = [source.wheel(name, version) for name, version in sorted(resolution.carried.items())]
    for wheel in wheels:
        if wheel.name.startswith(FUSED_PACKAGE.replace("-", "_")) and not wheel.name.endswith(
            "-py3-none-any.whl"
        ):
            raise SystemExit(f"{wheel.name}: {FUSED_PACKAGE} must be a pure-Python (py3-none-any) wheel")
    out.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copy2(wheel, out)) for wheel in wheels]


def report(resolution: Resolution) -> str:
    lines = [f"{name}=={version}" for name, version in sorted(resolution.carried.items())]
    lines += [f"CONFLICT {name}: {'; '.join(why)}" for name, why in sorted(resolution.conflicts.items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.device.closure", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--wheels", type=Path, metavar="OUTDIR", help="download the carried wheels into OUTDIR"
    )
    parser.add_argument("--python-version", help="the device's Python, X.Y (default: the manifest's)")
    parser.add_argument("--offline", action="store_true", help="installed metadata only (no index)")
    arguments = parser.parse_args(argv)
    manifest = load_manifest()
    if arguments.python_version is not None:
        if not re.fullmatch(r"3\.\d+", arguments.python_version):
            parser.error("--python-version must look like 3.12")
        manifest = Manifest(arguments.python_version, manifest.present, manifest.keep, manifest.absent)
    with tempfile.TemporaryDirectory(prefix="clef-wheels-") as cache:
        source: MetadataSource
        source = InstalledSource() if arguments.offline else IndexSource(manifest.python, Path(cache))
        resolution = derive(manifest, source)
        print(report(resolution))
        if resolution.conflicts:
            print("the carry list does not install together on the image", file=sys.stderr)
            return 1
        if arguments.wheels is not None and isinstance(source, IndexSource):
            download(resolution, source, arguments.wheels)
    return 0


if __name__ == "__main__":
    sys.exit(main())
