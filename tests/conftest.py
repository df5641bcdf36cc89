"""Shared test fixtures: generated V4 checkpoints, built once per session and never modified."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

# Tests use small tensors: one torch thread avoids oversubscribing the 2-core CI machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from ckpt_tool.fixtures.make import make_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def fixture_dir(tmp_path_factory: pytest.TempPathFactory):
    """``fixture_dir(variant)`` -> path of a read-only-by-convention generated checkpoint (cached per session)."""
    root = tmp_path_factory.mktemp("fixtures")
    made: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in made:
            made[variant] = make_checkpoint(root / variant, variant)
        return made[variant]

    return get


@pytest.fixture
def fixture_copy(fixture_dir, tmp_path: Path):
    """``fixture_copy(variant)`` -> a private copy of a fixture that a test may modify."""

    def get(variant: str) -> Path:
        dst = tmp_path / f"src-{variant}"
        shutil.copytree(fixture_dir(variant), dst)
        return dst

    return get
