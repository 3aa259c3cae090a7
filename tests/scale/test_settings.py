"""The scale-out options (``clef serve --ray``): their own settings object beside the server's, validated
with the flag named, and split from the server's options where a ``serve deploy`` config mixes them."""

from __future__ import annotations

from typing import Any

import pytest

from clef_runtime.options import OptionsError
from clef_runtime.scale import ray_serve
from clef_runtime.scale.settings import RAY_OPTIONS, RaySettings, split_ray_values
from clef_runtime.server.settings import OPTIONS, ServerSettings, SettingsError


def test_the_ray_options_are_the_ray_settings_fields() -> None:
    assert [option.field for option in RAY_OPTIONS] == list(RaySettings.__dataclass_fields__)
    assert not {option.flag for option in RAY_OPTIONS} & {option.flag for option in OPTIONS}


def test_defaults() -> None:
    settings = RaySettings()
    assert (settings.ray, settings.replicas, settings.ray_routing, settings.autoscaling) == (
        False,
        2,
        "state-affinity",
        False,
    )
    assert RaySettings(max_replicas=4).autoscaling
    # The smallest valid ranges: one replica at most, from one or from none.
    assert RaySettings(max_replicas=1).autoscaling and RaySettings(min_replicas=0, max_replicas=1).autoscaling


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"replicas": 0}, "--replicas"),
        ({"ray_max_owner_queue": 0}, "--ray-max-owner-queue"),
        ({"min_replicas": -1}, "--min-replicas must be >= 0"),
        (
            {"min_replicas": 3, "max_replicas": 2},
            "--max-replicas must be at least 1 and at least --min-replicas",
        ),
        ({"max_replicas": 0}, "--max-replicas must be at least 1"),
        ({"min_replicas": 0, "max_replicas": 0}, "--max-replicas must be at least 1"),
        ({"ray_routing": "random"}, "--ray-routing must be state-affinity or power-of-two"),
        ({"ray_num_gpus": -1}, "--ray-num-gpus"),
    ],
)
def test_bad_values_name_their_flag(values: dict[str, Any], needle: str) -> None:
    with pytest.raises(OptionsError, match=needle):
        RaySettings(**values)


def test_variables_are_read_and_bad_ones_named() -> None:
    environ = {"CLEF_RAY": "1", "CLEF_REPLICAS": "3", "CLEF_RAY_ROUTING": "Power-Of-Two"}
    assert RaySettings.from_sources(None, environ) == RaySettings(
        ray=True, replicas=3, ray_routing="power-of-two"
    )
    with pytest.raises(OptionsError, match="CLEF_RAY_NUM_CPUS"):
        RaySettings.from_sources(None, {"CLEF_RAY_NUM_CPUS": "lots"})


def test_split_ray_values() -> None:
    ray, rest = split_ray_values({"replicas": 4, "ray_num_cpus": 16, "cache_mb": 64, "api_keys": ["k"]})
    assert ray == {"replicas": 4, "ray_num_cpus": 16}
    assert rest == {"cache_mb": 64, "api_keys": ["k"]}


def test_app_builder_takes_server_engine_and_ray_options_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[tuple[ServerSettings, RaySettings]] = []
    monkeypatch.setattr(ray_serve, "build_application", lambda settings, ray: built.append((settings, ray)))
    args = {"model": "tiny", "replicas": 4, "ray_num_cpus": 16, "api_keys": ("change-me",), "cache_mb": 4096}
    ray_serve.app_builder(args)
    ((settings, ray),) = built
    assert (settings.model, settings.api_keys, settings.engine.cache_mb) == ("tiny", ("change-me",), 4096)
    assert (ray.ray, ray.replicas, ray.ray_num_cpus) == (True, 4, 16)
    with pytest.raises(SettingsError, match="--replicas"):
        ray_serve.app_builder({"model": "tiny", "replicas": 0})
    with pytest.raises(TypeError):
        ray_serve.app_builder({"model": "tiny", "replica_count": 2})
