"""The options of ``clef serve --ray`` (Ray Serve scale-out): one :class:`RaySettings` object, built from its
flags and ``CLEF_*`` variables by the same machinery as the server's own options (`clef_runtime.options`).

They sit beside the server's settings, not in them: the server knows nothing of how it is scaled out, and
``clef_runtime.scale.ray_serve`` takes both. The field names are also the keys ``app_builder`` reads from a
``serve deploy`` config.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from clef_runtime.options import Option, OptionsError, parse_bool, parse_int, parse_lower, read_option_values

__all__ = ["RAY_OPTIONS", "RaySettings", "split_ray_values"]

ROUTINGS = ("state-affinity", "power-of-two")


@dataclass(frozen=True)
class RaySettings:
    """How ``clef serve --ray`` deploys the model replicas. Immutable."""

    ray: bool = False
    """Serve on Ray Serve with ``replicas`` model replicas (state-affinity routing)."""
    replicas: int = 2
    """Model replicas (a fixed number unless min/max replicas are set)."""
    min_replicas: int | None = None
    """Autoscale on queue length between min and max replicas."""
    max_replicas: int | None = None
    ray_address: str | None = None
    """An existing Ray cluster to join; None starts a local head on 127.0.0.1."""
    ray_num_cpus: float = 1.0
    """CPUs reserved per model replica (also its torch threads)."""
    ray_num_gpus: float = 0.0
    """GPUs per model replica."""
    ray_routing: Literal["state-affinity", "power-of-two"] = "state-affinity"
    """How the ingress picks a model replica: by state key, or Ray Serve's default (for comparison)."""
    ray_max_owner_queue: int = 8
    """Requests queued on a state's owner replica beyond which the less loaded of two candidates answers."""

    def __post_init__(self) -> None:
        problems = []
        if self.replicas < 1 or self.ray_max_owner_queue < 1:
            problems.append("--replicas and --ray-max-owner-queue must be at least 1")
        if self.min_replicas is not None and self.min_replicas < 0:
            problems.append(f"--min-replicas must be >= 0, got {self.min_replicas}")
        # Checked alone too: autoscaling starts from 1 replica without --min-replicas, and Ray Serve would
        # refuse a maximum below that only after Ray has started.
        low = self.min_replicas if self.min_replicas is not None else 1
        if self.max_replicas is not None and self.max_replicas < max(1, low):
            problems.append("--max-replicas must be at least 1 and at least --min-replicas")
        if self.ray_routing not in ROUTINGS:
            problems.append(f"--ray-routing must be state-affinity or power-of-two, got {self.ray_routing!r}")
        if self.ray_num_cpus < 0 or self.ray_num_gpus < 0:
            problems.append("--ray-num-cpus and --ray-num-gpus must be >= 0")
        if problems:
            raise OptionsError("; ".join(problems))

    @property
    def autoscaling(self) -> bool:
        """Whether the replicas autoscale (min or max replicas set) rather than stay at ``replicas``."""
        return self.min_replicas is not None or self.max_replicas is not None

    @classmethod
    def from_sources(cls, args: argparse.Namespace | None, environ: Mapping[str, str]) -> RaySettings:
        """Settings from parsed flags, else ``CLEF_*`` variables, else the defaults. Raises
        `clef_runtime.options.OptionsError` naming the flag or variable of a bad value."""
        return cls(**read_option_values(args, environ, RAY_OPTIONS))


def split_ray_values(values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``values`` split into (the `RaySettings` fields, everything else), both by field name."""
    names = {f.name for f in dataclasses.fields(RaySettings)}
    ray = {key: value for key, value in values.items() if key in names}
    return ray, {key: value for key, value in values.items() if key not in names}


RAY_OPTIONS: tuple[Option, ...] = (
    Option(
        "ray",
        "--ray",
        "CLEF_RAY",
        parse_bool,
        "serve on Ray Serve: --replicas model replicas behind this endpoint, requests routed to the replica "
        "that holds their state (needs the 'ray' extra)",
        kind="bool",
    ),
    Option(
        "replicas", "--replicas", "CLEF_REPLICAS", parse_int, "model replicas with --ray (default 2)", "N"
    ),
    Option(
        "min_replicas",
        "--min-replicas",
        "CLEF_MIN_REPLICAS",
        parse_int,
        "with --ray: autoscale on queue length from this many replicas (with --max-replicas)",
        "N",
    ),
    Option(
        "max_replicas",
        "--max-replicas",
        "CLEF_MAX_REPLICAS",
        parse_int,
        "with --ray: autoscale up to this many replicas",
        "N",
    ),
    Option(
        "ray_address",
        "--ray-address",
        "CLEF_RAY_ADDRESS",
        str,
        "with --ray: join this Ray cluster (e.g. auto, or ray://head:10001) instead of starting a local "
        "head on 127.0.0.1",
        "ADDR",
    ),
    Option(
        "ray_num_cpus",
        "--ray-num-cpus",
        "CLEF_RAY_NUM_CPUS",
        float,
        "with --ray: CPUs reserved per model replica, also its torch threads (default 1)",
        "N",
    ),
    Option(
        "ray_num_gpus",
        "--ray-num-gpus",
        "CLEF_RAY_NUM_GPUS",
        float,
        "with --ray: GPUs per model replica (default 0)",
        "N",
    ),
    Option(
        "ray_routing",
        "--ray-routing",
        "CLEF_RAY_ROUTING",
        parse_lower,
        "with --ray: state-affinity (default: a state's requests go to the replica that holds it) or "
        "power-of-two (Ray Serve's default, for comparison)",
        "POLICY",
        choices=ROUTINGS,
    ),
    Option(
        "ray_max_owner_queue",
        "--ray-max-owner-queue",
        "CLEF_RAY_MAX_OWNER_QUEUE",
        parse_int,
        "with --ray: requests queued on a state's owner replica beyond which the less loaded of two "
        "candidates answers (default 8)",
        "N",
    ),
)
