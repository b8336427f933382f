"""Ray set-up around a training run: `connect_to_cluster` (dagster-ray's create → wait →
connect, run by the training asset only when it trains; a recording `RayResource` stands in for a
cluster, for our ordering logic only), Ray Train's defaults that Tessera changes, and
dagster-ray's Ray Data options, which Tessera's clusters apply on connect only when asked for."""

from __future__ import annotations

import os

import dagster as dg
import pytest
from dagster_ray import Lifecycle, RayResource
from pydantic import PrivateAttr

from resources.ray_cluster import ExternalRayCluster, connect_to_cluster


class _RecordingCluster(RayResource):
    lifecycle: Lifecycle = Lifecycle(create=False, wait=False, connect=False)
    _calls: list = PrivateAttr(default_factory=list)
    _made: bool = PrivateAttr(default=False)
    _up: bool = PrivateAttr(default=False)

    @property
    def host(self) -> str:
        return "ray-head"

    @property
    def name(self) -> str:
        return "recording"

    @property
    def created(self) -> bool:
        return self._made

    @property
    def ready(self) -> bool:
        return self._up

    def create(self, context):
        self._calls.append("create")
        self._made = True

    def wait(self, context):
        self._calls.append("wait")
        self._up = True

    def connect(self, context):
        self._calls.append("connect")


def test_a_cluster_is_created_then_awaited_then_connected_once_each():
    cluster = _RecordingCluster()
    context = dg.build_init_resource_context()
    connect_to_cluster(cluster, context)
    assert cluster._calls == ["create", "wait", "connect"]
    connect_to_cluster(cluster, context)  # already created and ready: only connects
    assert cluster._calls == ["create", "wait", "connect", "connect"]


def test_external_clusters_count_as_created_and_ready_so_training_only_connects():
    cluster = ExternalRayCluster(address="10.0.0.5:6379")
    assert cluster.created and cluster.ready


@pytest.mark.parametrize(("address", "host"), [("10.0.0.5:6379", "10.0.0.5"), ("ray://head:10001", "head"),
                                                ("[::1]:6379", "[::1]"), ("auto", "127.0.0.1")])
def test_an_external_clusters_dashboard_is_on_the_head_named_by_its_address(address, host):
    cluster = ExternalRayCluster(address=address)
    assert cluster.host == host
    assert cluster.dashboard_url == f"http://{host}:8265"


@pytest.mark.parametrize(
    ("field", "env", "setter", "local_default"),
    [("preemption_watcher", "PREEMPTION_WATCHER_ENV", "use_preemption_watcher", False),
     ("cluster_services", "CLUSTER_SERVICES_ENV", "use_cluster_services", False),
     ("pooled_worker_processes", "POOLED_PROCESSES_ENV", "use_pooled_worker_processes", True)],
    ids=["preemption watcher", "cluster services", "pooled worker processes"],
)
def test_local_ray_changes_ray_train_defaults_unless_the_operator_set_them(
    monkeypatch, field, env, setter, local_default
):
    from resources.ray_cluster import LocalRayCluster
    from training_core.train import ray_trainer

    env, use = getattr(ray_trainer, env), getattr(ray_trainer, setter)
    assert getattr(LocalRayCluster(), field) is local_default
    assert env in ray_trainer.LOCAL_RAY_SETTINGS_ENV  # left out where a child process trains on another cluster
    ours, theirs = ("1", "0") if local_default else ("0", "1")
    monkeypatch.delenv(env, raising=False)
    use(local_default)
    assert os.environ[env] == ours
    monkeypatch.setenv(env, theirs)  # set by the operator: kept
    use(local_default)
    assert os.environ[env] == theirs


@pytest.mark.parametrize("datasets", [None, {"train": lambda: None}], ids=["no datasets", "ray datasets"])
def test_trainer_starts_ray_datas_dataset_manager_only_for_ray_datasets(datasets):
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback

    from training_core.train.ray_trainer import torch_trainer_class

    trainer = torch_trainer_class()(lambda: None, datasets=datasets)
    kinds = {type(callback) for callback in trainer._create_default_callbacks()}
    assert (DatasetsCallback in kinds) == bool(datasets)


@pytest.mark.parametrize("setting", [None, "1", "0"], ids=["ray default", "on", "off"])
def test_trainer_uses_cluster_services_unless_turned_off(monkeypatch, setting):
    import ray.train
    import ray.train.torch
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
    from ray.train.v2._internal.execution.scaling_policy import FixedScalingPolicy, ResizeDecision

    from training_core.train.ray_trainer import CLUSTER_SERVICES_ENV, POOLED_PROCESSES_ENV, torch_trainer_class

    monkeypatch.setenv(POOLED_PROCESSES_ENV, "0")  # Ray's controller start-up, recorded below
    if setting is None:
        monkeypatch.delenv(CLUSTER_SERVICES_ENV, raising=False)
    else:
        monkeypatch.setenv(CLUSTER_SERVICES_ENV, setting)
    trainer = torch_trainer_class()(lambda: None, scaling_config=ray.train.ScalingConfig(num_workers=2))
    kinds = {type(callback) for callback in trainer._create_default_callbacks()}
    assert (PlacementGroupCleanerCallback in kinds) == (setting != "0")

    # the scaling policy the controller gets: Ray's own, or one that never asks the autoscaler
    sent = {}
    monkeypatch.setattr(ray.train.torch.TorchTrainer, "_initialize_and_run_controller",
                        lambda self, **kwargs: sent.update(kwargs))
    trainer._initialize_and_run_controller(scaling_policy=FixedScalingPolicy(trainer.scaling_config))
    policy = sent["scaling_policy"]
    assert isinstance(policy, FixedScalingPolicy) and policy.scaling_config.num_workers == 2
    assert (type(policy) is FixedScalingPolicy) == (setting != "0")
    if setting == "0":
        policy.after_controller_start(train_run_context=None)  # Ray's would create the coordinator actor
        assert policy._coordinator_client is None
        assert isinstance(policy.make_decision_for_non_running_worker_group(), ResizeDecision)


def test_the_controller_polls_again_at_once_only_after_a_report():
    from ray.train.v2._internal.execution.worker_group.poll import WorkerGroupPollStatus, WorkerStatus

    from training_core.train.ray_trainer import delivered_a_report

    def poll(*reports):
        return WorkerGroupPollStatus(worker_statuses={
            rank: WorkerStatus(running=True, training_report=report) for rank, report in enumerate(reports)})

    assert not delivered_a_report(poll(None, None))  # mid-epoch: Ray's health-check interval
    assert delivered_a_report(poll(None, object()))  # a checkpoint or the final report arrived
    assert not delivered_a_report(WorkerGroupPollStatus(worker_statuses={}))


def _ray_cluster_resource(kind: str, **options):
    """Each `ray_cluster` resource Tessera ships, lazy as the definitions build them."""
    from resources.kuberay_cluster import kuberay_cluster_from_manifest
    from resources.ray_cluster import LocalRayCluster

    lazy = Lifecycle(connect=False)
    if kind == "local":
        return LocalRayCluster(lifecycle=lazy, **options)
    if kind == "external":
        return ExternalRayCluster(address="10.0.0.5:6379", lifecycle=lazy, **options)
    return kuberay_cluster_from_manifest(**options)


@pytest.mark.parametrize("kind", ["local", "external", "kuberay"])
@pytest.mark.parametrize("opt_in", [False, True], ids=["default", "opted in"])
def test_ray_data_options_keep_their_type_when_dagster_rebuilds_the_resource(kind, opt_in):
    """Dagster rebuilds a resource from its config at run time; the options must come back as
    Tessera's `RayDataOptions`, applied on connect only when the definitions opted in."""
    from resources.ray_cluster import RayDataOptions

    seen = {}

    @dg.asset
    def uses_the_cluster(ray_cluster: RayResource) -> None:
        seen["options"] = ray_cluster.data_execution_options

    options = {"data_execution_options": RayDataOptions(apply_on_connect=True)} if opt_in else {}
    result = dg.materialize([uses_the_cluster], resources={"ray_cluster": _ray_cluster_resource(kind, **options)})
    assert result.success
    assert type(seen["options"]) is RayDataOptions
    assert seen["options"].apply_on_connect is opt_in


def test_ray_data_options_are_applied_only_when_asked_for(monkeypatch):
    import ray
    import ray.data

    from resources.ray_cluster import RayDataOptions

    context = ray.data.DataContext.get_current()
    before = context.execution_options.resource_limits
    try:
        RayDataOptions(execution_options={"cpu": 1}).apply()
        assert context.execution_options.resource_limits == before
        RayDataOptions(execution_options={"cpu": 1}, apply_on_connect=True).apply()
        assert context.execution_options.resource_limits.cpu == 1
    finally:
        context.execution_options.resource_limits = before

    def no_remote_task(*args, **kwargs):
        raise AssertionError("a remote task was submitted")

    monkeypatch.setattr(ray, "remote", no_remote_task)
    RayDataOptions().apply_remote()  # not applied: no task in a worker
    with pytest.raises(AssertionError, match="remote task"):
        RayDataOptions(apply_on_connect=True).apply_remote()


@pytest.mark.parametrize("address", ["garbage", "", "10.0.0.5", "10.0.0.5:port", "ray://:10001"])
def test_an_external_ray_address_must_be_host_and_port(address):
    from resources.ray_cluster import ExternalRayCluster

    with pytest.raises(Exception, match="expected HOST:PORT, ray://HOST:PORT or 'auto'"):
        ExternalRayCluster(address=address)
    for good in ("auto", "10.0.0.5:6379", "ray://head.svc:10001"):
        assert ExternalRayCluster(address=good).address == good


def test_local_ray_starts_its_own_ray_even_where_ray_address_points_at_a_cluster(monkeypatch):
    """Ray's own default (address None) joins RAY_ADDRESS or a `ray start` on this machine, with the
    local-only settings and none of ExternalRayCluster's reachability checks."""
    import ray

    from resources.ray_cluster import LocalRayCluster

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh step process
    addresses = []
    monkeypatch.setattr(ray, "init", lambda address=None, **options: addresses.append(address))
    LocalRayCluster().connect(dg.build_init_resource_context())
    assert addresses == ["local"]


def _closed_port() -> int:
    import socket

    with socket.socket() as probe:  # bound, never listening: connections are refused
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_an_unreachable_external_cluster_fails_the_connect_at_once_naming_the_address(monkeypatch):
    import ray

    from resources.ray_cluster import RayClusterUnreachable

    port = _closed_port()
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh step process
    cluster = ExternalRayCluster(address=f"127.0.0.1:{port}", connect_timeout_s=0.5)
    with pytest.raises(RayClusterUnreachable, match=rf"Ray cluster at 127.0.0.1:{port} \(TESSERA_RAY_ADDRESS or "
                       rf"ray_cluster.address\) did not accept a connection within 0.5 s: .*ray start --head "
                       rf"--port={port}"):
        cluster.connect(dg.build_init_resource_context())


def test_the_address_auto_is_not_probed():
    # A port that answers as Ray passes: tests/unit/test_ray_address_silent_peer.py (a bare listening socket
    # is the silent peer that check refuses).
    from resources.ray_cluster import wait_until_reachable

    wait_until_reachable("auto", timeout_s=0.1)  # Ray finds the address itself


def test_a_worker_group_larger_than_the_cluster_is_named_before_ray_train_waits_for_it():
    from training_core.train.config import TrainingConfig

    assert TrainingConfig(num_workers=2).capacity_shortfall([{"CPU": 2.0}]) is None
    assert TrainingConfig(num_workers=4).capacity_shortfall([{"CPU": 2.0}]) == (
        "num_workers=4 × 1 CPU per worker needs 4 CPU, and the Ray cluster has 2 in all; lower num_workers or "
        "cpus_per_worker, or train on a larger cluster")
    gpu = TrainingConfig(num_workers=2, use_gpu=True, cpus_per_worker=2)
    assert gpu.capacity_shortfall([{"CPU": 16.0, "GPU": 1.0}]).startswith(
        "num_workers=2 × 1 GPU per worker needs 2 GPU")
    assert gpu.capacity_shortfall([{"CPU": 3.0}]).startswith("num_workers=2 × 2 CPU per worker needs 4 CPU")
    assert TrainingConfig().capacity_shortfall([]).endswith("the Ray cluster has 0 in all; lower num_workers or "
                                                            "cpus_per_worker, or train on a larger cluster")


def test_a_worker_group_that_fits_the_cluster_totals_but_not_its_nodes_is_named():
    # Each worker is one placement-group bundle: its CPUs (and GPU) on one node, never split.
    from training_core.train.config import TrainingConfig

    three_by_two = TrainingConfig(num_workers=3, cpus_per_worker=2)  # 6 CPU, and the cluster has 6
    assert three_by_two.capacity_shortfall([{"CPU": 3.0}, {"CPU": 3.0}]) == (
        "num_workers=3 × 2 CPU per worker: Ray puts each worker's resources on one node, and the Ray nodes hold only "
        "2 of them (the largest node has 3 CPU; 2 alive nodes have 3 CPU each); lower num_workers or "
        "cpus_per_worker, or train on larger nodes")
    assert TrainingConfig(num_workers=2, cpus_per_worker=3).capacity_shortfall(
        [{"CPU": 2.0}, {"CPU": 2.0}, {"CPU": 2.0}]) == (
        "num_workers=2 × 3 CPU per worker: Ray puts each worker's resources on one node, and no Ray node holds one "
        "(the largest node has 2 CPU; 3 alive nodes have 2 CPU each); lower cpus_per_worker, or train on larger "
        "nodes")
    # The GPU is on the small node, the CPUs on the large one: 5 CPU and 1 GPU in all, yet no node holds a worker.
    gpu_worker = TrainingConfig(num_workers=1, cpus_per_worker=4, use_gpu=True)
    assert gpu_worker.capacity_shortfall([{"CPU": 4.0, "GPU": 0.0}, {"CPU": 1.0, "GPU": 1.0}]) == (
        "num_workers=1 × 4 CPU + 1 GPU per worker: Ray puts each worker's resources on one node, and no Ray node "
        "holds one (the largest node has 1 CPU + 1 GPU; 2 alive nodes have 4 CPU + 0 GPU, 1 CPU + 1 GPU); lower "
        "cpus_per_worker, or train on larger nodes")


@pytest.mark.parametrize("workers, cpus, gpu, nodes", [
    (3, 2, False, [{"CPU": 4.0}, {"CPU": 2.0}]),  # two workers share the large node
    (2, 3, False, [{"CPU": 3.0, "memory": 1e9}, {"CPU": 3.0}, {"CPU": 1.0}]),  # other resources do not matter
    (2, 4, True, [{"CPU": 8.0, "GPU": 2.0}, {"CPU": 64.0}]),  # both GPU workers on the GPU node
    (1, 1, False, [{"CPU": 1.0}]),
])
def test_a_worker_group_that_fits_the_nodes_passes(workers, cpus, gpu, nodes):
    from training_core.train.config import TrainingConfig

    assert TrainingConfig(num_workers=workers, cpus_per_worker=cpus, use_gpu=gpu).capacity_shortfall(nodes) is None


def _alive_nodes(*cpus: float, dead: float = 0.0) -> list[dict]:
    """``ray.nodes()`` as Ray reports it: dead nodes stay listed, with Alive false."""
    return [{"Alive": True, "Resources": {"CPU": c, "memory": 1e9}} for c in cpus] + (
        [{"Alive": False, "Resources": {"CPU": dead}}] if dead else [])


def test_only_a_cluster_that_can_add_nodes_waits_for_a_worker_group_larger_than_it(monkeypatch):
    import logging

    import ray

    from resources.ray_cluster import LocalRayCluster, check_cluster_capacity
    from training_core.errors import ConfigError
    from training_core.train.config import TrainingConfig

    monkeypatch.setattr(ray, "nodes", lambda: _alive_nodes(2.0, dead=8.0))  # a 2-core machine's Ray
    too_big, log = TrainingConfig(num_workers=3), logging.getLogger("test")
    check_cluster_capacity(TrainingConfig(num_workers=2), LocalRayCluster(), log)
    with pytest.raises(ConfigError, match="num_workers=3 × 1 CPU per worker needs 3 CPU, and the Ray cluster has 2"):
        check_cluster_capacity(too_big, LocalRayCluster(), log)
    with pytest.raises(ConfigError, match="needs 3 CPU"):
        check_cluster_capacity(too_big, ExternalRayCluster(address="10.0.0.5:6379", connect_timeout_s=0.05), log,
                               poll_s=0.01)
    joining = iter([_alive_nodes(2.0), _alive_nodes(2.0), _alive_nodes(2.0, 1.0)])  # a node registers while we wait
    monkeypatch.setattr(ray, "nodes", lambda: next(joining))
    check_cluster_capacity(too_big, ExternalRayCluster(address="10.0.0.5:6379", connect_timeout_s=5), log,
                           poll_s=0.01)
    monkeypatch.setattr(ray, "nodes", lambda: _alive_nodes(2.0))
    warnings = []
    monkeypatch.setattr(log, "warning", warnings.append)
    check_cluster_capacity(too_big, ExternalRayCluster(address="10.0.0.5:6379", autoscaling=True), log)
    assert warnings == ["num_workers=3 × 1 CPU per worker needs 3 CPU, and the Ray cluster has 2 in all; lower "
                        "num_workers or cpus_per_worker, or train on a larger cluster; waiting for the cluster's "
                        "autoscaler to add nodes"]
    monkeypatch.setattr(ray, "nodes", lambda: _alive_nodes(3.0, 3.0))  # 6 CPU in all, 3 per node
    with pytest.raises(ConfigError, match=r"num_workers=3 × 2 CPU per worker: Ray puts each worker's resources on one "
                                          r"node, and the Ray nodes hold only 2 of them"):
        check_cluster_capacity(TrainingConfig(num_workers=3, cpus_per_worker=2), LocalRayCluster(), log)


def test_workers_hide_only_the_library_deprecations_printed_on_every_step():
    import warnings

    from training_core.train.loop import quiet_known_library_warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_known_library_warnings()
        warnings.warn("`torch.distributed.reduce_scatter_tensor` is deprecated. Please use `x` instead.", FutureWarning)
        warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated. Please use `y` instead.", FutureWarning)
        warnings.warn("`some_other_api` is deprecated", FutureWarning)
    assert [str(w.message) for w in caught] == ["`some_other_api` is deprecated"]
