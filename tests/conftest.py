"""Shared pytest fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from seaweed import SeaweedServer, seaweed_server


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """One SeaweedFS S3 server for the whole test session; give each test its own prefix."""
    with seaweed_server(tmp_path_factory.mktemp("seaweed")) as server:
        yield server


@pytest.fixture(autouse=True)
def mlflow_uri_kept() -> Iterator[None]:
    """`mlflow.set_tracking_uri`, which a test's in-process stage or helper may call, exports
    MLFLOW_TRACKING_URI; left set, it would win over the config of every later test's stages
    (their MLflow runs and model versions would land in that test's database). MLflow's own
    module-level URI is put back too."""
    import sys

    before = os.environ.get("MLFLOW_TRACKING_URI")
    utils = sys.modules.get("mlflow.tracking._tracking_service.utils")
    module_uri = getattr(utils, "_tracking_uri", None)
    yield
    if before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before
    if (utils := sys.modules.get("mlflow.tracking._tracking_service.utils")) is not None:
        utils._tracking_uri = module_uri


@pytest.fixture(autouse=True)
def root_logging_kept() -> Iterator[None]:
    """A test that runs a stage's `setup_logging` in process replaces the root logger's
    handlers with one on that test's captured stderr, closed once it ends; left in place, a
    later test's log line fails on it and prints "--- Logging error ---" with the message
    into that test's stderr, where an assertion may read it."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
