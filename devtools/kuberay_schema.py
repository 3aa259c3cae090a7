"""The RayService schema that tests/deploy/test_kuberay.py validates deploy/kuberay-rayservice.yaml against,
extracted from KubeRay's CustomResourceDefinition.

KubeRay's CRD (``ray-operator/config/crd/bases/ray.io_rayservices.yaml``, Apache-2.0) is about 1 MB of YAML,
nearly all of it indentation; the ``openAPIV3Schema`` of its ``v1`` version is what the Kubernetes API
server checks a RayService against, and as compact JSON it is a sixth of that. Refresh it from a KubeRay
checkout at a release tag::

    git -C kuberay checkout v1.7.0
    python -m devtools.kuberay_schema kuberay/ray-operator/config/crd/bases/ray.io_rayservices.yaml \\
        --version v1.7.0 --commit "$(git -C kuberay rev-parse HEAD)" > tests/deploy/data/rayservice-v1.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

__all__ = ["SOURCE", "rayservice_schema"]

SOURCE = "https://github.com/ray-project/kuberay/blob/{version}/ray-operator/config/crd/bases/ray.io_rayservices.yaml"


def rayservice_schema(crd: dict[str, Any], version: str = "v1") -> dict[str, Any]:
    """The ``openAPIV3Schema`` of ``version`` in the RayService CRD ``crd``. Raises KeyError when the CRD
    has no such version (or is not the RayService's)."""
    if crd.get("kind") != "CustomResourceDefinition" or crd["spec"]["names"]["kind"] != "RayService":
        raise KeyError("not the RayService CustomResourceDefinition")
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            schema: dict[str, Any] = entry["schema"]["openAPIV3Schema"]
            return schema
    raise KeyError(f"the CRD has no version {version}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("crd", type=Path, help="ray.io_rayservices.yaml from a KubeRay checkout")
    parser.add_argument("--version", required=True, help="the KubeRay release tag, e.g. v1.7.0")
    parser.add_argument("--commit", required=True, help="the commit of that tag")
    args = parser.parse_args(argv)
    crd = yaml.safe_load(args.crd.read_text(encoding="utf-8"))
    # JSON has no comments: the attribution travels as fields beside the schema.
    document = {
        "source": SOURCE.format(version=args.version),
        "kuberay_version": args.version,
        "kuberay_commit": args.commit,
        "license": "Apache-2.0, by the KubeRay project (its LICENSE file); extracted unchanged: "
        "spec.versions[v1].schema.openAPIV3Schema",
        "openAPIV3Schema": rayservice_schema(crd),
    }
    json.dump(document, sys.stdout, separators=(",", ":"), sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
