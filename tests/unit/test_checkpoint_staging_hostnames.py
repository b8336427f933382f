"""Staging folders of workers on hosts whose names hold dashes, as every KubeRay pod's does
(`<cluster>-gpu-group-worker-<hash>`): the folder name is read from the right."""

from __future__ import annotations

import os
import socket

from training_core.process_identity import this_process
from training_core.train.checkpoint_staging import STAGING_PREFIX, remove_abandoned_checkpoint_staging

POD = "tessera-raycluster-gpu-group-worker-x7k2p"


def test_a_dead_workers_folder_on_a_pod_is_removed_and_a_live_ones_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: POD)
    dead = tmp_path / f"{STAGING_PREFIX}{POD}-{os.getpid()}-1.000-abcd1234"  # gone: our PID, another start time
    live = tmp_path / f"{STAGING_PREFIX}{this_process().replace(':', '-')}-efgh5678"
    other_pod = tmp_path / f"{STAGING_PREFIX}tessera-raycluster-gpu-group-worker-q9z8y-1-1.000-abcd1234"
    for folder in (dead, live, other_pod):
        folder.mkdir()

    assert remove_abandoned_checkpoint_staging(tmp_path) == [dead]
    assert sorted(tmp_path.iterdir()) == sorted([live, other_pod])
