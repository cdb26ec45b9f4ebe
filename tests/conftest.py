"""Shared pytest fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from seaweed import SeaweedServer, seaweed_server


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """One SeaweedFS S3 server for the whole test session; give each test its own prefix."""
    with seaweed_server(tmp_path_factory.mktemp("seaweed")) as server:
        yield server
