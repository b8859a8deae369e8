"""Fixtures of the vLLM engine tests: the tiny model with seeded random weights."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvtier.launch.testmodel import write_model

    return write_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", weights="random", seed=0)
