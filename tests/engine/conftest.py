"""Engine tests: vLLM 0.33.0's own classes and loaders, run in a subprocess (tests/engine/vllm_worker.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
WORKER = HERE / "vllm_worker.py"


def _load_install():
    spec = importlib.util.spec_from_file_location("ckpt_tool_engine_install", HERE / "install.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "engine: builds vLLM 0.33.0's own model classes on CPU (installs the wheel into .engine-site)"
    )


@pytest.fixture(scope="session")
def engine_site() -> Path:
    """The installed vLLM 0.33.0 site folder (``ENGINE_SITE`` overrides ``<repo>/.engine-site``).

    No wheel (no network, no pip cache) fails the tests: never a skip."""
    install = _load_install()
    site = Path(os.environ.get("ENGINE_SITE") or install.SITE)
    try:
        return install.ensure_installed(site, log=print)
    except RuntimeError as e:
        pytest.fail(f"vLLM 0.33.0 could not be installed: {e}", pytrace=False)


@pytest.fixture(scope="session")
def run_worker(engine_site):
    """``run_worker(jobs) -> list of results``: one worker process (one vLLM import) for a batch of jobs."""

    def run(jobs: list[dict], timeout: float = 900) -> list[dict]:
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        proc = subprocess.run(
            [sys.executable, str(WORKER), "--site", str(engine_site), "batch", "-"],
            input=json.dumps({"jobs": jobs}),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
        try:
            out = json.loads(proc.stdout)
        except ValueError:
            pytest.fail(
                f"vllm_worker.py gave no JSON (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}",
                pytrace=False,
            )
        return out["results"]

    return run
