"""Real Ray Train workers, at start: each removes the checkpoint staging of workers on its host
killed while checkpointing, then refuses to train when it runs other code than the driver recorded."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile

import pytest

from training_core.errors import LineageError
from training_core.train.checkpoint_staging import STAGING_PREFIX
from training_core.train.config import TrainingConfig
from training_core.train.launcher import run_training
from training_core.train.repeatable_failures import RECORD_NAME
from training_core.train.worker_code import CodeIdentity

pytestmark = pytest.mark.integration

KILLED_WHILE_STAGING = """
import os, signal
from training_core.train.checkpoint_staging import checkpoint_staging_directory
with checkpoint_staging_directory() as staging:
    print(staging, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_workers_refuse_other_code_than_recorded_after_sweeping_dead_workers_staging(
        ray_session, demo_model, demo_dataset, tmp_path):
    # The session's Ray workers share this process's temporary folder.
    killed = subprocess.run([sys.executable, "-c", KILLED_WHILE_STAGING], capture_output=True, text=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL
    left_behind = killed.stdout.strip()
    assert os.path.isdir(left_behind) and left_behind.startswith(os.path.join(tempfile.gettempdir(), STAGING_PREFIX))

    # What an older code location recorded; the workers run this checkout.
    running = CodeIdentity.of_this_process()
    recorded = dataclasses.replace(running, code_version="0" * 40, source_digest="0" * 12)
    with pytest.raises(LineageError) as refused:
        run_training(TrainingConfig(num_workers=2, max_steps=4, checkpoint_every_steps=2), model_path=demo_model.name_or_path,
                     train_dirs=[str(demo_dataset.train_dir)], seq_len=demo_dataset.seq_len, cache_dir=None,
                     storage_path=tmp_path / "ray", run_name="other-code", output_dir=tmp_path / "models",
                     recorded_code=recorded, max_failures=0)
    message = str(refused.value)
    assert (f"code: {'0' * 40}, sources {'0' * 12} (recorded) ≠ {running.code_version}, sources "
            f"{running.source_digest} (this worker)") in message
    assert "redeploy or restart it with the code location's image" in message
    assert "retries stopped before loading the model" in message
    run_folder = tmp_path / "ray" / "other-code"
    assert (run_folder / RECORD_NAME).is_file() and not list(run_folder.glob("checkpoint_*"))
    assert not os.path.exists(left_behind)
