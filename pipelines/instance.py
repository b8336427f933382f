"""The local Dagster instance under $TESSERA_HOME/dagster: telemetry off, training pool of 1."""

import os
import sys
from pathlib import Path

INSTANCE_SETTINGS = """\
telemetry:
  enabled: false
concurrency:
  pools:
    # Only lora_adapter uses a pool ("training"): at most this many trainings at once.
    default_limit: 1
"""


def prepare_home(home: str | None = None) -> Path:
    """Create the state root and DAGSTER_HOME, and export both for this process."""
    from resources.paths import default_home

    root = Path(home).resolve() if home else default_home()
    dagster_home = root / "dagster"
    dagster_home.mkdir(parents=True, exist_ok=True)
    settings = dagster_home / "dagster.yaml"
    if not settings.exists():
        settings.write_text(INSTANCE_SETTINGS)
    os.environ["TESSERA_HOME"] = str(root)
    os.environ["DAGSTER_HOME"] = str(dagster_home)
    return root


if __name__ == "__main__":
    print(prepare_home(sys.argv[1] if len(sys.argv) > 1 else None))
