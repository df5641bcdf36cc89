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
import threading
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
NEWEST = max(RELEASES, key=lambda r: tuple(map(int, r.version.split("."))))


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "engine: builds a verified vLLM release's own model classes on CPU (installs the wheel into .engine-site/)",
    )


@pytest.fixture(scope="session", params=RELEASES, ids=[r.id for r in RELEASES])
def vllm_release(request) -> Release:
    """The release under test (one column of the matrix)."""
    return request.param


def _installed_site(release: Release) -> Path:
    """The release's installed site folder (``ENGINE_SITES`` overrides the folder that holds them).

    No wheel (no network, no pip cache) fails the tests: never a skip."""
    install = _load_install()
    root = Path(os.environ.get("ENGINE_SITES") or install.SITES)
    try:
        return install.ensure_installed(release.version, install.site_of(release.version, root), log=print)
    except RuntimeError as e:
        pytest.fail(f"vLLM {release.version} could not be installed: {e}", pytrace=False)


@pytest.fixture(scope="session")
def engine_site(vllm_release: Release) -> Path:
    """The site folder of the release under test (one column of the matrix)."""
    return _installed_site(vllm_release)


@pytest.fixture(scope="session")
def newest_engine_site() -> Path:
    """The newest verified release's site folder, for tests of what ckpt-tool does around the engine (how it words a
    vLLM that cannot be built, which model file a serving interpreter judges with) rather than of what a release
    holds: they run once, not once a column (CI time)."""
    return _installed_site(NEWEST)


class ServedWorker:
    """One ``vllm_worker.py serve`` process of a release, shared by every engine test of the session: vLLM is
    imported once a release, not once a test (every job still builds its own model). Its stderr (vLLM's logs) goes
    to a file, whose part written during a failed batch is shown; a worker that died or hung is replaced."""

    def __init__(self, site: Path, log: Path) -> None:
        self.site, self.log = site, log
        self.proc: subprocess.Popen | None = None
        self.stderr = None

    def _start(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        self.stderr = open(self.log, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), "--site", str(self.site), "serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            env=env,
        )

    def batch(self, jobs: list[dict], timeout: float) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self.stop()
            self._start()
        start = self.log.stat().st_size
        answer: list[str] = []
        reader = threading.Thread(target=lambda: answer.append(self.proc.stdout.readline()), daemon=True)
        try:
            self.proc.stdin.write(json.dumps({"jobs": jobs}) + "\n")
            self.proc.stdin.flush()
        except OSError:
            pass  # it died: the empty answer below says so, with its stderr
        reader.start()
        reader.join(timeout)
        line = answer[0] if answer else ""
        try:
            return json.loads(line)
        except ValueError:
            hung = reader.is_alive()
            self.stop()
            with open(self.log, "rb") as fh:
                fh.seek(start)
                tail = fh.read().decode(errors="replace")[-6000:]
            pytest.fail(
                f"vllm_worker.py {'gave no answer within ' + str(timeout) + ' s' if hung else 'died'} "
                f"(answer {line[-2000:]!r}):\n{tail}",
                pytrace=False,
            )

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.stdin.close()
                try:
                    self.proc.wait(30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            self.proc = None
        if self.stderr is not None:
            self.stderr.close()
            self.stderr = None


@pytest.fixture(scope="session")
def run_worker(engine_site, vllm_release, tmp_path_factory):
    """``run_worker(jobs) -> list of results``: the release's served worker (one vLLM import a session) runs a batch
    of jobs."""
    worker = ServedWorker(engine_site, tmp_path_factory.mktemp("worker") / f"vllm-{vllm_release.version}.log")

    def run(jobs: list[dict], timeout: float = 900) -> list[dict]:
        out = worker.batch(jobs, timeout)
        judged = out.get("meta", {}).get("vllm_version")
        assert judged == vllm_release.version, (
            f"the worker imported vLLM {judged} from {engine_site}, not {vllm_release.version}"
        )
        return out["results"]

    yield run
    worker.stop()


_CONVERTED: dict[tuple, Path] = {}  # one conversion per (variant, tp, ep, target, extra) for the whole session


@pytest.fixture(scope="session")
def converted(fixture_dir, tmp_path_factory, vllm_release):
    """``converted(variant, tp, ep=False, target=None, *extra) -> OUT``: ``ckpt-tool convert`` of a fixture, made once
    a session and shared by every engine test and release that asks for the same (never modify it: copy it first);
    the target defaults to the profile verified against the release under test."""
    return _converter(fixture_dir, tmp_path_factory, vllm_release.profile)


@pytest.fixture(scope="session")
def newest_converted(fixture_dir, tmp_path_factory):
    """:func:`converted` for the tests that run on the newest release only (``newest_engine_site``)."""
    return _converter(fixture_dir, tmp_path_factory, NEWEST.profile)


def _converter(fixture_dir, tmp_path_factory, profile: str):
    root = tmp_path_factory.getbasetemp() / "engine-outs"
    root.mkdir(exist_ok=True)

    def get(variant: str, tp: int, ep: bool = False, target: str | None = None, *extra: str) -> Path:
        target = target or profile
        key = (variant, tp, ep, target, extra)
        if key not in _CONVERTED:
            out = root / f"{variant}-tp{tp}{'-ep' if ep else ''}-{target}{''.join(extra).replace('-', '_')}"
            cmd = [sys.executable, "-m", "ckpt_tool", "convert", str(fixture_dir(variant)), str(out),
                   "--tp", str(tp), "--target", target, *(["--moe-parallel", "ep"] if ep else []), *extra]  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=HERE.parents[1], timeout=600)
            assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
            _CONVERTED[key] = out
        return _CONVERTED[key]

    return get
