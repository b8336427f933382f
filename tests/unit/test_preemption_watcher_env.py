"""RAY_TRAIN_ENABLE_PREEMPTION_WATCHER is Ray's variable: Tessera's pre-flight check must read it as Ray's
controller does (ray_constants.env_bool), or refuse it, never believe the watcher on while Ray runs it off."""

from __future__ import annotations

import pytest
from ray._private import ray_constants

from training_core.errors import ConfigError
from training_core.train.ray_trainer import (
    HEALTH_CHECK_INTERVAL_ENV,
    PREEMPTION_WATCHER_ENV,
    use_quick_health_checks,
)


@pytest.mark.parametrize("value", [None, "1", "0", "true", "TRUE", "False", "yes", "on", "YES", "no", "off", "",
                                   " 1", "true ", "ture", "2"])
def test_tessera_reads_the_preemption_watcher_switch_as_ray_does_or_refuses_it(monkeypatch, value):
    from training_core.train.ray_trainer import ray_env_switch

    monkeypatch.setenv(HEALTH_CHECK_INTERVAL_ENV, "0.5")
    if value is None:
        monkeypatch.delenv(PREEMPTION_WATCHER_ENV, raising=False)
    else:
        monkeypatch.setenv(PREEMPTION_WATCHER_ENV, value)
    ray_reads = ray_constants.env_bool(PREEMPTION_WATCHER_ENV, True)
    try:
        use_quick_health_checks()
    except ConfigError:
        return  # refused before a trainer starts: nothing can disagree
    assert ray_env_switch(PREEMPTION_WATCHER_ENV, default=True) is ray_reads


@pytest.mark.parametrize("value", ["yes", "on", "", " 1"])
def test_a_value_ray_reads_as_off_but_that_looks_on_is_refused_with_the_accepted_values(monkeypatch, value):
    monkeypatch.setenv(HEALTH_CHECK_INTERVAL_ENV, "0.5")
    monkeypatch.setenv(PREEMPTION_WATCHER_ENV, value)
    with pytest.raises(ConfigError, match=rf"{PREEMPTION_WATCHER_ENV}={value!r}: expected 1/true or 0/false"):
        use_quick_health_checks()


@pytest.mark.parametrize(("value", "expected"), [(None, True), ("1", True), ("TRUE", True), ("0", False),
                                                 ("false", False)])
def test_the_values_ray_reads_unambiguously_are_accepted(monkeypatch, value, expected):
    from training_core.train.ray_trainer import ray_env_switch

    if value is None:
        monkeypatch.delenv(PREEMPTION_WATCHER_ENV, raising=False)
    else:
        monkeypatch.setenv(PREEMPTION_WATCHER_ENV, value)
    assert ray_env_switch(PREEMPTION_WATCHER_ENV, default=True) is expected
