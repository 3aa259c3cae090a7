"""Turn a ``--model`` value into a release directory on disk.

Three forms:

- ``"tiny"``: the built-in untrained test model, built once into ``<cache_dir()>/tiny-<version>/`` and reused;
- an existing local directory in the release layout;
- a Hugging Face repo id with an optional ``@revision``: a known release (``Cloudflare/clef-flash``,
  ``Cloudflare/clef``: `KNOWN_RELEASES`) defaults to its pinned revision, other repos to ``main``. Only the
  release files are fetched (never ``*.py``); with ``HF_HUB_OFFLINE=1`` only the local Hugging Face cache is
  consulted.

`model_identity` names the weights a spec points to without resolving it (no download, no build): what
batch jobs record, so that a job is only ever answered by the model it was submitted to.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from clef_runtime.model.checkpoint import (
    PINNED_REVISION,  # noqa: F401 (re-exported: Clef-flash's pinned revision, as before known releases)
    RELEASE_FILE_PATTERNS,
    CheckpointError,
    KnownRelease,
    known_release,
)
from clef_runtime.release import CONFIG_FILE

__all__ = [
    "TINY_SPEC",
    "ModelIdentity",
    "ModelResolutionError",
    "ResolvedModel",
    "model_identity",
    "resolve_model",
    "tiny_cache_path",
]

logger = logging.getLogger(__name__)

TINY_SPEC = "tiny"
_TRUTHY = {"1", "true", "yes", "on"}


class ModelResolutionError(CheckpointError):
    """A ``--model`` value names no usable checkpoint (not cached offline, unknown repo, bad spec)."""


@dataclass(frozen=True)
class ResolvedModel:
    """Where a model spec points: ``path`` is a release directory; ``expected_sizes`` is set for the pinned
    revision of a known release whose file sizes are published (Clef-flash's): pass it to
    `verify_checkpoint` to check them."""

    path: Path
    name: str
    revision: str | None
    is_tiny: bool
    expected_sizes: Mapping[str, int] | None = None


def _tiny_version() -> str:
    from clef_runtime.model.tiny import TINY_FORMAT
    from clef_runtime.version import __version__

    return f"{__version__}-f{TINY_FORMAT}"


def tiny_cache_path() -> Path:
    """Directory the built-in tiny checkpoint lives in: ``<cache_dir()>/tiny-<package version>-f<format>``."""
    from clef_runtime.encoding.tokenizer import cache_dir

    return Path(cache_dir()) / f"tiny-{_tiny_version()}"


def _ensure_tiny() -> Path:
    """Build the tiny checkpoint once; concurrent builders each write a private temp dir, one rename wins."""
    from clef_runtime.model.tiny import make_tiny

    final = tiny_cache_path()
    if (final / CONFIG_FILE).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        make_tiny(staging / "checkpoint")
        try:
            # rename(2) of a directory is atomic and fails when the target exists and is not empty, so a
            # reader never sees a half-written checkpoint and the first finished builder wins.
            os.rename(staging / "checkpoint", final)
            logger.info("built the tiny checkpoint in %s", final)
        except OSError as error:
            if not (final / CONFIG_FILE).is_file():
                raise ModelResolutionError(
                    f"{final} exists but is not a complete tiny checkpoint; delete it and retry"
                ) from error
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def _hf_offline() -> bool:
    from huggingface_hub import constants

    # Read the environment at call time: huggingface_hub reads it once at import.
    value = os.environ.get("HF_HUB_OFFLINE")
    if value is not None:
        return value.strip().lower() in _TRUTHY
    return bool(constants.HF_HUB_OFFLINE)


def _hf_cache_dir() -> Path:
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def _split_spec(spec: str) -> tuple[str, str | None]:
    repo_id, _, revision = spec.partition("@")
    return repo_id, (revision or None)


def _revision_of(repo_id: str, revision: str | None) -> str:
    """The revision loaded for ``repo_id``: the one given, else a known release's pinned one, else main."""
    if revision is not None:
        return revision
    release = known_release(repo_id)
    return release.revision if release is not None else "main"


def _expected_sizes(release: KnownRelease | None, revision: str) -> Mapping[str, int] | None:
    """The published file sizes to verify ``revision`` against: a known release's, at its pinned revision
    only (another revision has other files), and only where they are published."""
    if release is None or revision != release.revision:
        return None
    return release.file_sizes


def _local_dir(spec: str) -> Path | None:
    """The resolved directory ``spec`` names, or None when it names none (a local directory wins over a repo
    id of the same spelling)."""
    local = Path(spec).expanduser()
    return local.resolve() if local.is_dir() else None


@dataclass(frozen=True)
class ModelIdentity:
    """Which weights a spec loads, known before they load: ``name`` as the spec gives it, ``ref`` the same
    for every spelling of the same weights and different for other weights."""

    name: str
    ref: str


def model_identity(spec: str) -> ModelIdentity:
    """The identity of the ``--model`` value ``spec``, as `resolve_model` would resolve it: ``tiny`` by its
    build (random weights differ between builds), a local directory by its resolved path, a Hugging Face
    repo by its lower-cased id with its revision (a known release's pinned one, ``main`` for others). Any
    other value stands for itself. Nothing is downloaded or built."""
    spec = spec.strip()
    if spec == TINY_SPEC:
        return ModelIdentity(TINY_SPEC, tiny_cache_path().name)
    local = _local_dir(spec)
    if local is not None:
        return ModelIdentity(local.name, str(local))
    repo_id, revision = _split_spec(spec)
    if repo_id.count("/") != 1:
        return ModelIdentity(repo_id, spec)
    # The Hub matches repo ids case-insensitively: every spelling of one repo loads the same weights.
    return ModelIdentity(repo_id, f"{repo_id.lower()}@{_revision_of(repo_id, revision)}")


def _is_tiny_dir(path: Path) -> bool:
    import json

    try:
        config = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    marker = config.get("clef_runtime") if isinstance(config, dict) else None
    return isinstance(marker, dict) and marker.get("tiny") is True


_PROBE_TIMEOUT_S = 5.0
"""How long to wait for the Hub to answer before using the local cache alone. Without it huggingface_hub
retries an unreachable Hub five times with backoff (about 25 s) and then fails the same way."""


def _hf_endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT.rstrip("/")


def _hub_unreachable(endpoint: str) -> str | None:
    """Why the Hub at ``endpoint`` cannot be reached (one short phrase), or None when it answers at all (any
    HTTP status: errors such as 401 or 404 are reported by the download itself). One request, no retries;
    huggingface_hub's shared HTTP client is used, so proxies and certificates are the download's."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    timeout = min(_PROBE_TIMEOUT_S, float(constants.HF_HUB_ETAG_TIMEOUT))
    try:
        get_session().head(f"{endpoint}/api/models", timeout=timeout)
    except Exception as error:  # any failure to get an HTTP answer (refused, DNS, proxy, TLS, timeout)
        if "timeout" in type(error).__name__.lower():
            return f"no answer within {timeout:g} s"
        return _one_line(error)
    return None


def _how_to_get(repo_id: str, revision: str) -> str:
    return (
        f"with network access run `hf download {repo_id} --revision {revision}` (then it is cached); to use "
        "a copy already in the Hugging Face cache set HF_HUB_OFFLINE=1; or pass a local release directory "
        "with --model DIR"
    )


def _download(repo_id: str, revision: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = _hf_offline()
    cache = _hf_cache_dir()
    unreachable = None if offline else _hub_unreachable(_hf_endpoint())
    try:
        snapshot = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache,
            # An unreachable Hub: the cache alone, at once (a cached copy still loads).
            local_files_only=offline or unreachable is not None,
            allow_patterns=list(RELEASE_FILE_PATTERNS),
            ignore_patterns=["*.py"],
        )
    except (RepositoryNotFoundError, GatedRepoError) as error:
        raise ModelResolutionError(
            f"Hugging Face repo {repo_id!r} was not found or is not accessible ({type(error).__name__})"
        ) from error
    except RevisionNotFoundError as error:
        raise ModelResolutionError(f"Hugging Face repo {repo_id!r} has no revision {revision!r}") from error
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as error:
        where = f"the local Hugging Face cache ({cache})"
        if unreachable is not None:
            message = (
                f"downloading {repo_id}@{revision} failed: the Hugging Face Hub at {_hf_endpoint()} cannot "
                f"be reached ({unreachable}) and the model is not in {where}"
            )
        elif offline:
            message = f"{repo_id}@{revision} is not in {where} and HF_HUB_OFFLINE=1 forbids downloading"
        else:
            message = f"downloading {repo_id}@{revision} failed ({_one_line(error)})"
        raise ModelResolutionError(f"{message}; {_how_to_get(repo_id, revision)}") from error
    return Path(snapshot)


def _one_line(error: BaseException) -> str:
    # huggingface_hub's messages run over several lines; the first says what happened.
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def resolve_model(spec: str) -> ResolvedModel:
    """Resolve a model spec (``tiny``, a local directory, or ``org/name[@revision]``) to a release directory.

    The directory is not verified here (see `verify_checkpoint`); for a known release's pinned revision the
    result carries its published file sizes to verify against (Clef-flash's; none are published for Clef).
    Returns a `ResolvedModel`. Raises `ModelResolutionError` (a CheckpointError) when the spec is not a
    directory and not a valid repo id, the repo/revision does not exist, or it is not cached while offline
    (the message says how to download it).
    """
    spec = spec.strip()
    if not spec:
        raise ModelResolutionError("empty model spec; use 'tiny', a directory or a Hugging Face repo id")
    if spec == TINY_SPEC:
        return ResolvedModel(path=_ensure_tiny(), name=TINY_SPEC, revision=None, is_tiny=True)

    local = _local_dir(spec)
    if local is not None:
        return ResolvedModel(path=local, name=local.name, revision=None, is_tiny=_is_tiny_dir(local))

    repo_id, revision = _split_spec(spec)
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    not_a_spec = ModelResolutionError(
        f"model {spec!r} is not 'tiny', not an existing directory, and not a Hugging Face repo id "
        "('org/name' or 'org/name@revision')"
    )
    if spec.startswith((".", "/", "~")) or repo_id.count("/") != 1:
        raise not_a_spec
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise not_a_spec from error
    release = known_release(repo_id)
    revision = _revision_of(repo_id, revision)
    path = _download(repo_id, revision)
    return ResolvedModel(
        path=path,
        name=repo_id,
        revision=revision,
        is_tiny=_is_tiny_dir(path),
        expected_sizes=_expected_sizes(release, revision),
    )
