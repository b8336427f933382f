"""Ray Train set-up that Tessera changes from Ray's defaults, each for a measured reason.

Pinned to Ray 2.60 (Train V2); each change falls back to Ray's behaviour if its internals move."""

from __future__ import annotations

import functools
import os

PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"


def use_preemption_watcher(enabled: bool) -> None:
    """Whether the trainers this process starts next run Ray Train's preemption watcher (an actor
    per run that polls whether a node is being drained; Ray's default is on). It pays off where
    nodes are drained (autoscaled or spot clusters). A one-node local cluster never is, and there
    the actor's start-up, about 1.3 CPU-s of imports while the workers import and load the model,
    made a 2-worker run start 1.2-2.8 s later on 2 cores. The driver's environment is read when a
    `TorchTrainer` starts and passed on to its controller; a value set before this call wins."""
    os.environ.setdefault(PREEMPTION_WATCHER_ENV, "1" if enabled else "0")


def use_quick_health_checks() -> None:
    """Ray Train's controller polls its workers every ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``; Ray's
    default added seconds to the end of every run. 0.5 s unless the environment sets it; read
    from the driver's environment when a trainer starts."""
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")


@functools.cache
def torch_trainer_class() -> type:
    """``TorchTrainer``, minus Ray Data's ``DatasetsCallback`` when the run passes no Ray Dataset
    (Tessera never does: batches come from the row-group reader). Ray Train V2 otherwise starts a
    ``DatasetManager`` actor per run that imports Ray Data, ~0.8 CPU-s while the workers start:
    three alternating fresh-process runs each put 2-worker start-up at 16.2 / 16.3 / 14.2 s with
    it and 14.9 / 14.6 / 13.1 s without. Workers get no dataset shard provider, which only
    ``ray.train.get_dataset_shard`` would use."""
    from ray.train.torch import TorchTrainer

    try:
        from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    except ImportError:  # Ray moved it: keep Ray's behaviour
        return TorchTrainer
    if not hasattr(TorchTrainer, "_create_default_callbacks"):
        return TorchTrainer

    class TorchTrainerWithoutIdleDatasets(TorchTrainer):
        def _create_default_callbacks(self):
            callbacks = super()._create_default_callbacks()
            if self.datasets:
                return callbacks
            return [callback for callback in callbacks if not isinstance(callback, DatasetsCallback)]

    return TorchTrainerWithoutIdleDatasets
