"""Engine tests: each verified vLLM release's own classes and loaders, run in a subprocess
(tests/engine/vllm_worker.py).

The matrix's columns come from the profiles' data (``ckpt_tool.mapping.profiles.verified_releases``): every release a
profile is verified against is installed into its own site folder from its own pinned requirements file
(tests/engine/install.py), and every engine test that takes the ``vllm_release`` fixture runs once per release,
its test id ending in ``vllm-<release>``. Adding a verified release to a profile adds its column; nothing here
changes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from ckpt_tool.mapping.profiles import verified_releases

HERE = Path(__file__).resolve().parent
WORKER = HERE / "vllm_worker.py"


def _load_install():
    spec = importlib.util.spec_from_file_location("ckpt_tool_engine_install", HERE / "install.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@dataclass(frozen=True)
class Release:
    """One column of the engine matrix: a vLLM release and the profile verified against it."""

    version: str
    profile: str

    @property
    def id(self) -> str:
        return f"vllm-{self.version}"


RELEASES = [Release(v, p) for v, p in verified_releases()]


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "engine: builds a verified vLLM release's own model classes on CPU (installs the wheel into .engine-site/)",
    )


@pytest.fixture(scope="session", params=RELEASES, ids=[r.id for r in RELEASES])
def vllm_release(request) -> Release:
    """The release under test (one column of the matrix)."""
    return request.param


@pytest.fixture(scope="session")
def engine_site(vllm_release: Release) -> Path:
    """The release's installed site folder (``ENGINE_SITES`` overrides the folder that holds them).

    No wheel (no network, no pip cache) fails the tests: never a skip."""
    install = _load_install()
    root = Path(os.environ.get("ENGINE_SITES") or install.SITES)
    try:
        return install.ensure_installed(vllm_release.version, install.site_of(vllm_release.version, root), log=print)
    except RuntimeError as e:
        pytest.fail(f"vLLM {vllm_release.version} could not be installed: {e}", pytrace=False)


@pytest.fixture(scope="session")
def run_worker(engine_site, vllm_release):
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
        judged = out.get("meta", {}).get("vllm_version")
        assert judged == vllm_release.version, (
            f"the worker imported vLLM {judged} from {engine_site}, not {vllm_release.version}"
        )
        return out["results"]

    return run
