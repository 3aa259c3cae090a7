"""deploy/kuberay-rayservice.yaml without a cluster: it validates against KubeRay's RayService schema (made
strict: a misspelled key fails here instead of being pruned silently by the API server), its serveConfigV2
is deploy/ray-serve.yaml with only the documented changes, and both configs are valid Serve configs whose
args app_builder accepts."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from clef_runtime.scale import ray_serve

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "deploy" / "kuberay-rayservice.yaml"
SERVE_CONFIG = REPO / "deploy" / "ray-serve.yaml"
SCHEMA = Path(__file__).parent / "data" / "rayservice-v1.json"  # devtools/kuberay_schema.py

# What a cluster needs that a local run does not (the manifest's comment on serveConfigV2 says the same).
KUBERAY_CHANGES: dict[tuple[str | int, ...], Any] = {
    ("http_options", "host"): "0.0.0.0",
    ("applications", 0, "args", "model"): "/models/clef-flash",
    ("applications", 0, "args", "ray_num_cpus"): 4,
    ("applications", 0, "args", "ray_num_gpus"): 1,
}


def strict(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that declares its properties and
    neither allows other keys itself nor preserves unknown fields (what the API server prunes)."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: strict(value) for key, value in schema.items()}
    closed = "properties" in result and "additionalProperties" not in result
    if closed and not result.get("x-kubernetes-preserve-unknown-fields"):
        result["additionalProperties"] = False
    return result


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft4Validator:
    # Kubernetes' structural schemas are OpenAPI v3 schemas, a subset of JSON Schema draft 4 (x-kubernetes-*
    # keys are ignored; int-or-string fields are written as anyOf integer/string).
    schema = strict(json.loads(SCHEMA.read_text(encoding="utf-8"))["openAPIV3Schema"])
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


def manifest() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(MANIFEST.read_text(encoding="utf-8"))
    return document


def problems(validator: jsonschema.Draft4Validator, document: dict[str, Any]) -> list[str]:
    return [
        f"{'.'.join(map(str, error.absolute_path))}: {error.message}"
        for error in validator.iter_errors(document)
    ]


def test_the_manifest_is_a_valid_rayservice(validator: jsonschema.Draft4Validator) -> None:
    document = manifest()
    assert (document["apiVersion"], document["kind"]) == ("ray.io/v1", "RayService")
    assert problems(validator, document) == []


@pytest.mark.parametrize(
    ("path", "value", "complaint"),
    [
        (("spec", "rayClusterConfig", "workerGroupSpecs", 0, "replicas"), "two", "is not of type 'integer'"),
        (("spec", "rayClusterConfig", "workerGroupSpecs", 0, "groupName"), None, "'groupName' is a required"),
        (("spec", "rayClusterConfig"), None, "'rayClusterConfig' is a required property"),
        (
            (
                "spec",
                "rayClusterConfig",
                "workerGroupSpecs",
                0,
                "template",
                "spec",
                "containers",
                0,
                "resources",
                "limits",
                "cpu",
            ),
            "six",
            "does not match",
        ),
    ],
)
def test_a_wrong_type_or_a_missing_field_fails_validation(
    validator: jsonschema.Draft4Validator, path: tuple[str | int, ...], value: Any, complaint: str
) -> None:
    document = manifest()
    *parents, last = path
    target = document
    for key in parents:
        target = target[key]
    if value is None:
        del target[last]
    else:
        target[last] = value
    assert any(complaint in problem for problem in problems(validator, document)), problems(
        validator, document
    )


def test_a_misspelled_key_fails_validation(validator: jsonschema.Draft4Validator) -> None:
    document = manifest()
    document["spec"]["rayClusterSpecs"] = document["spec"]["rayClusterConfig"]
    assert any("'rayClusterSpecs' was unexpected" in problem for problem in problems(validator, document))
    document = manifest()
    probe = document["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    probe["readinessProbe"]["httpGet"]["paht"] = "/ready"
    assert any("'paht' was unexpected" in problem for problem in problems(validator, document))


def test_the_replicas_are_probed_on_ready() -> None:
    for group in manifest()["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        (container,) = group["template"]["spec"]["containers"]
        assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": 8000}, group["groupName"]
    groups = {
        group["groupName"]: group for group in manifest()["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    }
    gpu = groups["gpu"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert gpu == 1 and "cpu" in groups


def with_changes(config: dict[str, Any], changes: dict[tuple[str | int, ...], Any]) -> dict[str, Any]:
    changed = copy.deepcopy(config)
    for (*parents, last), value in changes.items():
        target: Any = changed
        for key in parents:
            target = target[key]
        target[last] = value
    return changed


def test_serve_config_v2_is_the_local_config_with_the_documented_changes() -> None:
    in_cluster = yaml.safe_load(manifest()["spec"]["serveConfigV2"])
    local = yaml.safe_load(SERVE_CONFIG.read_text(encoding="utf-8"))
    assert in_cluster == with_changes(local, KUBERAY_CHANGES)


@pytest.mark.parametrize("source", ["ray-serve.yaml", "serveConfigV2"])
def test_both_configs_are_serve_configs_whose_args_the_builder_takes(
    source: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ray.serve.schema import ServeDeploySchema

    if source == "serveConfigV2":
        config = yaml.safe_load(manifest()["spec"]["serveConfigV2"])
    else:
        config = yaml.safe_load(SERVE_CONFIG.read_text(encoding="utf-8"))
    (application,) = ServeDeploySchema.model_validate(config).applications
    assert (application.name, application.route_prefix) == (ray_serve.APP_NAME, "/")
    assert application.import_path == "clef_runtime.scale.ray_serve:app_builder"
    # Replicas and their resources come from args only (the config's comment says why).
    assert not application.deployments
    built: list[Any] = []
    monkeypatch.setattr(ray_serve, "build_application", lambda settings, ray: built.append((settings, ray)))
    ray_serve.app_builder(application.args)
    ((settings, ray),) = built
    assert (settings.model, ray.replicas) == (application.args["model"], application.args["replicas"])
