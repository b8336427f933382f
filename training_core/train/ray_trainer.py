"""Ray Train set-up that Tessera changes from Ray's defaults, each for a measured reason.

Pinned to Ray 2.60 (Train V2); each change falls back to Ray's behaviour if its internals move."""

from __future__ import annotations

import functools
import os
import threading
from typing import Callable

from training_core.errors import ConfigError

PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
# Tessera's own switches (Ray has none): read by `torch_trainer_class()`'s trainers when they start.
CLUSTER_SERVICES_ENV = "TESSERA_RAY_TRAIN_CLUSTER_SERVICES"
POOLED_PROCESSES_ENV = "TESSERA_RAY_TRAIN_POOLED_PROCESSES"


def use_preemption_watcher(enabled: bool) -> None:
    """Whether the trainers this process starts next run Ray Train's preemption watcher (an actor
    per run that polls whether a node is being drained; Ray's default is on). It pays off where
    nodes are drained (autoscaled or spot clusters). A one-node local cluster never is, and there
    the actor's start-up, about 1.3 CPU-s of imports while the workers import and load the model,
    made a 2-worker run start 1.2-2.8 s later on 2 cores. The driver's environment is read when a
    `TorchTrainer` starts and passed on to its controller; a value set before this call wins."""
    os.environ.setdefault(PREEMPTION_WATCHER_ENV, "1" if enabled else "0")


def use_cluster_services(enabled: bool) -> None:
    """Whether the trainers this process starts next use two Ray Train services that exist for
    shared, autoscaled clusters (Ray's default is on):

    * the placement-group cleaner, a detached actor per run that removes the run's placement group
      if the controller process dies without cleaning up; the controller blocks until it is up,
      and stopping it adds ~1 s to the end of every run;
    * resource requests to Ray Data's autoscaling coordinator, a detached actor created by the
      first run on a cluster, which imports Ray Data; the controller blocks on it too.

    A one-node local Ray started by this process has no autoscaler and ends with the process, which
    frees every placement group; on 2 cores each of these actors' start-up also competes with the
    workers' (measurements in docs/training_benchmark.md). A value set in the environment before
    this call wins."""
    os.environ.setdefault(CLUSTER_SERVICES_ENV, "1" if enabled else "0")


def use_pooled_worker_processes(enabled: bool) -> None:
    """Whether the trainers this process starts next run their controller and workers in Ray's
    pooled worker processes (Ray's default is off). Ray Train gives each of those actors a
    ``runtime_env`` holding its ``RAY_TRAIN_*`` settings, and Ray starts a fresh Python process
    for every actor with a runtime env of its own: the controller first, then the workers, about
    1-2 s each on 2 cores. Without it, Ray hands them worker processes it has already started
    (imported Ray, connected), and Tessera applies the same settings in each actor instead: a
    no-op 2-worker run in a fresh local Ray (what every Dagster run is) started ~3 s sooner,
    later runs ~1.5 s sooner (docs/training_benchmark.md). A value set in the environment before
    this call wins."""
    os.environ.setdefault(POOLED_PROCESSES_ENV, "1" if enabled else "0")


# What a local cluster sets in this process's environment. Nothing unsets them: a Tessera process trains on
# one kind of cluster. Only a process that trains on local Ray and launches a child to train on another
# cluster must leave them out of the child's environment (tests/integration/test_external_cluster.py does).
LOCAL_RAY_SETTINGS_ENV = (PREEMPTION_WATCHER_ENV, CLUSTER_SERVICES_ENV, POOLED_PROCESSES_ENV)


def use_local_ray_defaults() -> None:
    """A one-node local Ray owned by this process: no preemption watcher, no cluster services,
    pooled worker processes (as `LocalRayCluster` runs it by default)."""
    use_preemption_watcher(False)
    use_cluster_services(False)
    use_pooled_worker_processes(True)


_SWITCH_VALUES = {"1": True, "true": True, "yes": True, "on": True,
                  "0": False, "false": False, "no": False, "off": False}


def env_switch(name: str, default: bool) -> bool:
    """An on/off setting from the environment: unset or empty gives ``default``; 1/0, true/false,
    yes/no, on/off in any case; anything else is refused, naming the variable, before a trainer
    starts (a typo must not silently pick one of the two behaviours)."""
    raw = os.environ.get(name, "")
    if not raw.strip():
        return default
    try:
        return _SWITCH_VALUES[raw.strip().lower()]
    except KeyError:
        raise ConfigError(f"{name}={raw!r}: expected 1 or 0 (or true/false, yes/no, on/off)") from None


# Ray reads its own RAY_* switches with ray._common.utils.env_bool: once set, only 1 or true (any case, no
# spaces) is on, so a value env_switch reads as on (yes, on, " 1") or as the default (empty) would be off for Ray.
_RAY_SWITCH_VALUES = {"1": True, "true": True, "0": False, "false": False}


def ray_env_switch(name: str, default: bool) -> bool:
    """An on/off setting that Ray reads from the environment, read as Ray reads it: unset gives
    ``default``; 1/0 or true/false in any case; anything else, which Ray would quietly read as off
    (yes, on, an empty value, spaces, a typo), is refused, naming the variable, before a trainer starts."""
    if name not in os.environ:
        return default
    raw = os.environ[name]
    try:
        return _RAY_SWITCH_VALUES[raw.lower()]
    except KeyError:
        raise ConfigError(f"{name}={raw!r}: expected 1/true or 0/false (any case); Ray reads any other value, "
                          "even yes or on, as off. Unset it for Ray's default") from None


def _cluster_services_enabled() -> bool:
    return env_switch(CLUSTER_SERVICES_ENV, default=True)  # Ray's default


def _pooled_processes_enabled() -> bool:
    return env_switch(POOLED_PROCESSES_ENV, default=False)  # Ray's default


HEALTH_CHECK_INTERVAL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"


def use_quick_health_checks() -> None:
    """Ray Train's controller polls its workers every ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``; Ray's
    default added seconds to the end of every run. 0.5 s unless the environment sets it; read
    from the driver's environment when a trainer starts. A value set there is checked here: Ray
    would fail on it only inside its controller, after the cluster was set up."""
    raw = os.environ.setdefault(HEALTH_CHECK_INTERVAL_ENV, "0.5")
    try:
        interval = float(raw)
    except ValueError:
        interval = -1.0
    if not 0 < interval < float("inf"):
        raise ConfigError(f"{HEALTH_CHECK_INTERVAL_ENV}={raw!r}: expected a number of seconds > 0")
    ray_env_switch(PREEMPTION_WATCHER_ENV, default=True)  # refuses a typo before a trainer starts


@functools.cache
def torch_trainer_class() -> type:
    """``TorchTrainer`` without the Ray Train actors a Tessera run does not need:

    * Ray Data's ``DatasetsCallback`` when the run passes no Ray Dataset (Tessera never does:
      batches come from the row-group reader). Ray Train V2 otherwise starts a ``DatasetManager``
      actor per run that imports Ray Data, ~0.8 CPU-s while the workers start: three alternating
      fresh-process runs each put 2-worker start-up at 16.2 / 16.3 / 14.2 s with it and 14.9 /
      14.6 / 13.1 s without. Workers get no dataset shard provider, which only
      ``ray.train.get_dataset_shard`` would use.
    * The placement-group cleaner and the autoscaling coordinator's resource requests when
      :func:`use_cluster_services` turned them off.
    * The controller's and the workers' runtime envs when :func:`use_pooled_worker_processes`
      turned on pooled processes.

    Each is kept, as Ray has it, if Ray moved the class this relies on."""
    import ray
    from ray.train.torch import TorchTrainer

    if not hasattr(TorchTrainer, "_create_default_callbacks"):
        return TorchTrainer
    try:
        from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    except ImportError:
        DatasetsCallback = None  # noqa: N806 - Ray moved it: keep Ray's behaviour
    try:
        from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
    except ImportError:
        PlacementGroupCleanerCallback = None  # noqa: N806
    policy_replacement = _fixed_scaling_without_autoscaler()  # (Ray's class, ours) or None
    pooled_controller = _controller_in_pooled_process()  # (controller class, settings) or None

    class TesseraTorchTrainer(TorchTrainer):
        def _create_default_callbacks(self):
            unneeded: list[type] = []
            if DatasetsCallback is not None and not self.datasets:
                unneeded.append(DatasetsCallback)
            if PlacementGroupCleanerCallback is not None and not _cluster_services_enabled():
                unneeded.append(PlacementGroupCleanerCallback)
            return [callback for callback in super()._create_default_callbacks()
                    if not isinstance(callback, tuple(unneeded))]

        def _initialize_and_run_controller(self, **controller_init_kwargs):
            policy = controller_init_kwargs.get("scaling_policy")
            if policy_replacement is not None and not _cluster_services_enabled():
                ray_fixed, without_autoscaler = policy_replacement
                if type(policy) is ray_fixed:  # elastic policies need the coordinator: left alone
                    controller_init_kwargs["scaling_policy"] = without_autoscaler(policy.scaling_config)
            if pooled_controller is None or not _pooled_processes_enabled():
                return super()._initialize_and_run_controller(**controller_init_kwargs)
            # Ray's method without the controller's runtime_env; the settings travel as an argument.
            controller_class, ray_train_settings = pooled_controller
            controller = ray.remote(
                num_cpus=0,
                label_selector={ray._raylet.RAY_NODE_ID_KEY: ray.get_runtime_context().get_node_id()},
            )(controller_class).remote(ray_train_settings=ray_train_settings(), **controller_init_kwargs)
            if threading.current_thread() is threading.main_thread():
                self._register_sigint_handler(controller)  # Ctrl-C aborts the run, as in Ray's
            ray.get(controller.run.remote())
            return ray.get(controller.get_result.remote())

    return TesseraTorchTrainer


def _controller_in_pooled_process() -> tuple[type, Callable[[], dict]] | None:
    """A Ray Train controller class that runs in a pooled worker process, with workers that do too,
    and the function that gives the ``RAY_TRAIN_*`` settings Ray would have put in their runtime
    envs (None if Ray moved what this relies on). Each actor applies those settings to its own
    process's environment when it starts, before Ray Train reads them; pooled processes are only
    ever used by one actor, which ends with the run. Defined in a function: see
    :func:`_fixed_scaling_without_autoscaler`."""
    import ray
    from ray.train.torch import TorchTrainer

    try:
        from ray.train.v2._internal.constants import (
            DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE,
            RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR,
            get_env_vars_to_propagate,
        )
        from ray.train.v2._internal.execution.controller.controller import TrainController
        from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup
    except ImportError:
        return None
    needed = [(TrainController, "worker_group_cls"), (TrainController, "_poll_workers"),
              (WorkerGroup, "_get_worker_runtime_env"),
              (WorkerGroup, "_create_workers"), (TorchTrainer, "_register_sigint_handler"),
              (ray._raylet, "RAY_NODE_ID_KEY")]
    if not all(hasattr(owner, name) for owner, name in needed):
        return None

    def ray_train_settings() -> dict:
        """What Ray's `_initialize_and_run_controller` puts in the controller's runtime env."""
        settings = get_env_vars_to_propagate()
        settings.setdefault(RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR, DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE)
        return settings

    class PooledProcessWorkerGroup(WorkerGroup):
        @staticmethod
        def _get_worker_runtime_env(custom_runtime_env):
            if custom_runtime_env:  # a process of its own anyway: Ray's runtime env, settings included
                return WorkerGroup._get_worker_runtime_env(custom_runtime_env)
            return {}

        def _create_workers(self, *args, **kwargs):
            workers = super()._create_workers(*args, **kwargs)
            # What Ray's worker runtime env would carry: the controller's settings (its environment).
            settings = get_env_vars_to_propagate()
            ray.get([worker.actor.execute.remote(_apply_settings, settings) for worker in workers])
            return workers

    class PooledProcessTrainController(TrainController):
        worker_group_cls = PooledProcessWorkerGroup

        def __init__(self, *, ray_train_settings: dict, **kwargs):
            _apply_settings(ray_train_settings)  # before Ray Train reads them, as a runtime env would
            super().__init__(**kwargs)
            self._poll_again_at_once = False

        async def _poll_workers(self):
            # Ray waits a health-check interval between polls, and a worker hands over one report
            # per poll and counts as running until it has: the end of a run took a poll for the
            # final report and another, an interval later, to see the workers done (0.7-1.0 s
            # after the training function ended; 0.2-0.3 s with this).
            if self._poll_again_at_once and hasattr(self, "_latest_poll_time"):
                self._latest_poll_time = float("-inf")  # Ray's interval counts from this
            status = await super()._poll_workers()
            self._poll_again_at_once = delivered_a_report(status)
            return status

    PooledProcessTrainController.__qualname__ = "PooledProcessTrainController"  # its name in Ray's state API
    return PooledProcessTrainController, ray_train_settings


def delivered_a_report(status) -> bool:
    """Whether a Ray Train worker-group poll handed over a worker's report (a checkpoint, or the
    last one before the training function returns): the controller then polls again at once."""
    return any(worker.training_report is not None for worker in status.worker_statuses.values())


def _apply_settings(settings: dict) -> None:
    """In a pooled process that now runs one Ray Train actor: what a runtime env would have set."""
    os.environ.update(settings)


def _fixed_scaling_without_autoscaler() -> tuple[type, type] | None:
    """Ray's fixed-size scaling policy and a subclass without its requests to the autoscaling
    coordinator (None if Ray moved either). Defined in a function, not at module level, so that
    importing this module does not import Ray; cloudpickle sends the class to the controller by
    value."""
    try:
        from ray.train.v2._internal.execution.scaling_policy import FixedScalingPolicy
    except ImportError:
        return None
    needed = ("after_controller_start", "_maybe_send_resource_request", "_send_resource_request")
    if not all(hasattr(FixedScalingPolicy, name) for name in needed):
        return None

    class FixedScalingWithoutAutoscaler(FixedScalingPolicy):
        """Same decisions; no resource requests (a one-node local cluster has no autoscaler). With
        no coordinator client, Ray's shutdown and abort hooks have nothing to cancel."""

        def after_controller_start(self, train_run_context):
            return None

        def _maybe_send_resource_request(self):
            return None

        def _send_resource_request(self):
            return None

    return FixedScalingPolicy, FixedScalingWithoutAutoscaler
