"""One local Ray instance (bound to loopback) for the whole test session, and the default model."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def ray_instance() -> Iterator[Any]:
    """Ray on 127.0.0.1 with two CPUs and a small object store, shared by every Ray test."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("torch")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started = not ray.is_initialized()
    if started:
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            object_store_memory=256 * 1024**2,
            _node_ip_address="127.0.0.1",
            logging_level="WARNING",
        )
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny model, built once per session."""
    from stalebound.engines.models import build_default_model

    return build_default_model(tmp_path_factory.mktemp("ray-model"), seed=0)
