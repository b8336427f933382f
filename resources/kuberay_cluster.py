"""Ray on Kubernetes: dagster-ray's `KubeRayCluster` built from deploy/kuberay/raycluster.yaml.

One manifest, two ways to use it:
- attach (default): the RayCluster named in the manifest is applied with `kubectl` and stays up.
  A training step that trains finds it by name (creating it from the manifest only if it is
  missing), waits until it is ready, connects with Ray Client and never deletes it.
- ephemeral: a training step that trains creates its own RayCluster from the manifest's spec
  (dagster-ray generates the name) and deletes it when the step ends.
A step that reuses an earlier training run (same inputs, config and code) touches no cluster.

Either way the step pod is the Ray driver: it needs the shared volume (deploy/shared-state.yaml)
mounted at the same path as the Ray pods, and no GPU (deploy/k8s_tags.py, `training_on_kuberay`).
"""

from __future__ import annotations

import copy
import difflib
import re
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import yaml
from dagster_ray import Lifecycle
from dagster_ray.kuberay import KubeRayCluster, RayClusterConfig, RayClusterSpec
from pydantic import BaseModel, ValidationError

from resources.paths import REPO_ROOT
from resources.ray_cluster import ClusterCeiling, RayDataOptions, ray_data_options_field

DEFAULT_MANIFEST = REPO_ROOT / "deploy" / "kuberay" / "raycluster.yaml"
GROUP_KEYS = ("headGroupSpec", "workerGroupSpecs")
RAYCLUSTER_API_VERSION = "ray.io/v1"
HEAD_SERVICE_SUFFIX = "-head-svc"  # KubeRay names a RayCluster's head service <cluster name>-head-svc


class KubeRayManifestError(ValueError):
    """The RayCluster manifest cannot be turned into a dagster-ray resource."""


class TrainingKubeRayCluster(KubeRayCluster):
    """dagster-ray's `KubeRayCluster`, applying its Ray Data options on connect only when asked for
    (`RayDataOptions`: Tessera's training reads no Ray Dataset), and knowing how far its RayCluster
    can grow (`capacity_ceiling`)."""

    data_execution_options: RayDataOptions = ray_data_options_field()

    @property
    def capacity_ceiling(self) -> ClusterCeiling | None:
        """The RayCluster's nodes at its largest: a worker group no autoscaling can hold is refused
        before Ray Train starts retrying for it, one the autoscaler can reach is waited for."""
        spec = self.ray_cluster.spec
        name = self.ray_cluster.metadata.get("name")
        return raycluster_ceiling(f"RayCluster {name}" if name else "the RayCluster this step creates",
                                  spec.head_group_spec, spec.worker_group_specs, spec.enable_in_tree_autoscaling)


def raycluster_ceiling(cluster_label: str, head_group: Mapping[str, Any], worker_groups: list[Mapping[str, Any]],
                       autoscaling: bool) -> ClusterCeiling | None:
    """The Ray nodes of a RayCluster at its largest: each worker group's pods at `maxReplicas` (at
    `replicas` without the autoscaler; × `numOfHosts`) and the head, each with the resources the Ray
    autoscaler itself reads from the group (rayStartParams, else the Ray container's limits or
    requests), so the ceiling is the one it scales to. None when a worker group sets no bound
    (Kubernetes then defaults `maxReplicas` to 2^31 - 1: no ceiling worth checking against)."""
    bound = "maxReplicas" if autoscaling else "replicas"
    if any(bound not in group for group in worker_groups):
        return None
    head = _ray_node_resources(cluster_label, "spec.headGroupSpec", head_group, is_head=True)
    nodes, described = [head], []
    for index, group in enumerate(worker_groups):
        per_pod = _ray_node_resources(cluster_label, f"spec.workerGroupSpecs[{index}]", group, is_head=False)
        hosts = int(group.get("numOfHosts", 1))
        nodes += [per_pod] * (int(group[bound]) * hosts)
        described.append(f"worker group {group.get('groupName', index)}: {bound} {group[bound]}"
                         f"{f' × {hosts} hosts' if hosts > 1 else ''} × {_cpus_and_gpus(per_pod)} per pod")
    described.append(f"head: {_cpus_and_gpus(head)}")
    return ClusterCeiling(tuple(nodes), f"{cluster_label} ({'; '.join(described)})")


def _ray_node_resources(cluster_label: str, where: str, group: Mapping[str, Any], is_head: bool) -> dict[str, float]:
    # The autoscaler's own reading of a group spec (Ray is pinned to one version in pyproject.toml).
    from ray.autoscaler._private.kuberay.autoscaling_config import _get_ray_resources_from_group_spec

    try:
        resources = _get_ray_resources_from_group_spec(dict(group), is_head)
    except (KeyError, ValueError) as error:
        raise KubeRayManifestError(
            f"{cluster_label}, {where}: the Ray autoscaler cannot tell its resources: {error}") from error
    return {name: float(amount) for name, amount in resources.items()}


def _cpus_and_gpus(resources: Mapping[str, float]) -> str:
    return ", ".join(f"{resources.get(name, 0.0):g} {name}" for name in ("CPU", "GPU"))


def attached_raycluster_ceiling(ray_address: str, path: str | Path = DEFAULT_MANIFEST) -> ClusterCeiling | None:
    """The ceiling of the manifest's RayCluster when ``ray_address`` is its head service (e.g.
    ray://tessera-ray-head-svc.tessera.svc.cluster.local:10001, or the service's short name), else
    None. The manifest is read only for an address that names a KubeRay head service."""
    host = ray_address.removeprefix("ray://").rpartition(":")[0]
    service, _, domain = host.partition(".")
    if not service.endswith(HEAD_SERVICE_SUFFIX):
        return None
    cluster = kuberay_cluster_from_manifest(path)
    name, namespace = cluster.ray_cluster.metadata["name"], cluster.ray_cluster.metadata.get("namespace")
    if service != f"{name}{HEAD_SERVICE_SUFFIX}" or (domain and namespace and domain.split(".")[0] != namespace):
        return None  # another RayCluster's head: its size is not in this manifest
    return cluster.capacity_ceiling


def load_raycluster_manifest(path: str | Path = DEFAULT_MANIFEST) -> dict[str, Any]:
    """The single `RayCluster` object of a YAML file, checked for kind and apiVersion."""
    path = Path(path)
    try:
        documents = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    except (OSError, yaml.YAMLError) as error:
        raise KubeRayManifestError(f"{path}: cannot read a YAML RayCluster manifest: {error}") from error
    clusters = [doc for doc in documents if isinstance(doc, dict) and doc.get("kind") == "RayCluster"]
    if len(clusters) != 1:
        raise KubeRayManifestError(f"{path}: expected exactly one object of kind RayCluster, found {len(clusters)}")
    manifest = clusters[0]
    if manifest.get("apiVersion") != RAYCLUSTER_API_VERSION:
        raise KubeRayManifestError(
            f"{path}: apiVersion is {manifest.get('apiVersion')!r}; dagster-ray creates {RAYCLUSTER_API_VERSION!r}"
        )
    if not isinstance(manifest.get("spec"), dict):
        raise KubeRayManifestError(f"{path}: the RayCluster has no spec")
    _check_groups(path, manifest["spec"])
    return manifest


def _check_groups(path: Path, spec: Mapping[str, Any]) -> None:
    """The head group and every worker group exist and have containers. Without this, a typo such
    as `workerGroupSpec` passed through and dagster-ray's default groups replaced the manifest's."""
    for key in spec:
        near = difflib.get_close_matches(key, GROUP_KEYS, n=1, cutoff=0.8)
        if near and key != near[0]:
            raise KubeRayManifestError(f"{path}: spec.{key} is not a RayCluster field; did you mean spec.{near[0]}?")
    groups: list[tuple[str, Any]] = [("spec.headGroupSpec", spec.get("headGroupSpec"))]
    workers = spec.get("workerGroupSpecs", [])
    if not isinstance(workers, list):
        raise KubeRayManifestError(f"{path}: spec.workerGroupSpecs must be a list of groups, got {type(workers).__name__}")
    groups += [(f"spec.workerGroupSpecs[{i}]", group) for i, group in enumerate(workers)]
    for where, group in groups:
        if not isinstance(group, Mapping):
            raise KubeRayManifestError(f"{path}: {where} is missing or not a mapping")
        containers = ((group.get("template") or {}).get("spec") or {}).get("containers")
        if not isinstance(containers, list) or not containers:
            raise KubeRayManifestError(f"{path}: {where}.template.spec.containers must list the Ray container")
        if not isinstance(group.get("rayStartParams", {}), Mapping):
            raise KubeRayManifestError(f"{path}: {where}.rayStartParams must be a mapping of ray start flags")


def raycluster_config_from_manifest(manifest: Mapping[str, Any]) -> RayClusterConfig:
    """dagster-ray's `RayClusterConfig` holding the manifest's metadata and spec.

    dagster-ray declares the spec's fields in snake_case (`head_group_spec`) and converts them back
    to camelCase when it creates the cluster; fields it does not declare pass through as they are.
    Feeding it camelCase keys for declared fields would keep its defaults *and* add the manifest's
    keys, which it rejects as a collision, hence the renaming here."""
    metadata = dict(manifest.get("metadata") or {})
    try:
        spec = RayClusterSpec(**_declared_fields_in_snake_case(RayClusterSpec, manifest["spec"]))
        return RayClusterConfig(
            kind=manifest.get("kind", "RayCluster"),
            api_version=manifest.get("apiVersion", RAYCLUSTER_API_VERSION),
            metadata=metadata,
            spec=spec,
        )
    except ValidationError as error:
        raise KubeRayManifestError(f"RayCluster {metadata.get('name', '<unnamed>')}: {error}") from error


def kuberay_cluster_from_manifest(
    path: str | Path = DEFAULT_MANIFEST,
    *,
    ephemeral: bool = False,
    image: str | None = None,
    **resource_options: Any,
) -> TrainingKubeRayCluster:
    """The `ray_cluster` resource for production definitions (replaces `LocalRayCluster`): dagster-ray's
    `KubeRayCluster`, with Ray Data options applied on connect only when asked for.

    `image` replaces the image of every Ray container (e.g. the immutable tag of this release);
    `resource_options` go to `KubeRayCluster` as they are (`timeout`, `ray_init_options`, ...)."""
    manifest = copy.deepcopy(load_raycluster_manifest(path))
    if image is not None:
        for group in _group_specs(manifest["spec"]):
            for container in group["template"]["spec"]["containers"]:
                container["image"] = image
    if ephemeral:
        manifest.setdefault("metadata", {}).pop("name", None)
    elif not (manifest.get("metadata") or {}).get("name"):
        raise KubeRayManifestError(f"{path}: attaching to a RayCluster needs metadata.name")
    unknown = sorted(set(resource_options) - set(TrainingKubeRayCluster.model_fields))
    if unknown:
        raise KubeRayManifestError(f"unknown KubeRay resource option(s) {unknown}; "
                                   f"known: {sorted(TrainingKubeRayCluster.model_fields)}")
    options: dict[str, Any] = {
        "ray_cluster": raycluster_config_from_manifest(manifest),
        # Nothing at step start: the training asset creates / waits / connects only when it trains
        # (`connect_to_cluster`), so a step that reuses an earlier run starts no cluster.
        # attach: the cluster outlives the step; ephemeral: the step's cluster goes with it.
        "lifecycle": Lifecycle(create=False, wait=False, connect=False, cleanup="always" if ephemeral else "never"),
        **resource_options,
    }
    return TrainingKubeRayCluster(**options)


def _group_specs(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [spec["headGroupSpec"], *spec.get("workerGroupSpecs", [])]


def _snake_case(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _declared_fields_in_snake_case(model: type[BaseModel], values: Mapping[str, Any]) -> dict[str, Any]:
    """Rename keys of `values` that are declared fields of `model` (recursing into nested config
    models, e.g. `authOptions.secretName`); leave every other key untouched."""
    fields = model.model_fields
    renamed: dict[str, Any] = {}
    for key, value in values.items():
        name = _snake_case(key)
        if name not in fields:
            renamed[key] = value
            continue
        nested = _config_model(fields[name].annotation)
        renamed[name] = (
            _declared_fields_in_snake_case(nested, value) if nested and isinstance(value, Mapping) else value
        )
    return renamed


def _config_model(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside `X`, `X | None` or `Optional[X]`, if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in (Union, types.UnionType):
        for arg in get_args(annotation):
            if (model := _config_model(arg)) is not None:
                return model
    return None


__all__ = [
    "DEFAULT_MANIFEST",
    "KubeRayManifestError",
    "attached_raycluster_ceiling",
    "kuberay_cluster_from_manifest",
    "load_raycluster_manifest",
    "raycluster_ceiling",
    "raycluster_config_from_manifest",
]
