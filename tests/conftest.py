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


def _no_cuda_reason() -> str | None:
    """Why the tests marked ``cuda`` cannot run here, or None where torch sees a CUDA device."""
    import torch

    if torch.version.cuda is None:
        return f"needs a CUDA device: this torch ({torch.__version__}) is built without CUDA"
    if not torch.cuda.is_available():
        return f"needs a CUDA device: torch {torch.__version__} (CUDA {torch.version.cuda}) sees none"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` (registered in pyproject.toml) are skipped, with the reason, where there is no GPU."""
    marked = [item for item in items if item.get_closest_marker("cuda")]
    reason = _no_cuda_reason() if marked else None
    if reason:
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=reason))
