"""`WorkerConfig.validate`: the worker's two publishing intervals must be positive (an
interval of 0 would spin its publishing loop)."""

from __future__ import annotations

import pytest

from shared.config import ConfigError, WorkerConfig


@pytest.mark.parametrize(("field", "message"), [("kv_event_interval_s", "KV event interval"),
                                                ("load_interval_s", "load interval")])
def test_a_publishing_interval_must_be_positive(field: str, message: str) -> None:
    for bad in (0.0, -1.0):
        with pytest.raises(ConfigError, match=f"the {message} must be positive"):
            WorkerConfig(worker_id="w1", model_dir="/m", **{field: bad}).validate()
    WorkerConfig(worker_id="w1", model_dir="/m", **{field: 0.1}).validate()
