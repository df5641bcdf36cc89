"""Prove the CUDA path in one call on a machine with one GPU, and say what ran in one line (docs/testing.md).

    python3 tests/cuda_check.py                  # from the repository root, on the GPU machine: ~3-6 min, <= 8
    python3 tests/cuda_check.py --rehearse       # without a GPU: the same steps on the CPU (plumbing, not a proof)
    python3 tests/cuda_check.py --no-skeleton    # the tests and the fixture only
    python3 tests/cuda_check.py --json FILE      # also every step's figures and output tails

Steps, each in a process of its own, all within ``--budget`` seconds (default 480):

1. What the machine has: torch and its CUDA build, the GPU, triton, and the project's other imports. The project
   runs from this tree (``PYTHONPATH``): nothing is built or fetched. A package that is missing is installed from
   wheels in ``.whl/`` (``pip --no-index``, into a temporary folder) where that folder exists, else named in the
   summary. No torch with CUDA, or no GPU: the summary says so and the exit status is 2.
2. The tests marked ``cuda`` (tests/test_cuda.py: the compiled Triton FP8-block, MXFP4 and NVFP4 GEMMs on the GPU
   against the CPU path, and ``verify --level numeric --device cuda`` on a fixture). With a GPU none may be skipped.
3. ``ckpt-tool verify --level numeric --device cuda`` on the fp4 fixture (``ckpt_tool.fixtures.make``) converted at
   tp 2: it must pass, with the compiled kernels (backend ``triton``) on the GPU and 100 % numeric coverage.
4. If at least ``SKELETON_NEEDS`` seconds are left: the same on the full-width V4-Flash MTP skeleton
   (``bench/make_skeleton.py``: 5.3 GiB, 256 MXFP4 experts) converted ``--only mtp --tp 8``.

The last line printed is the summary: ``cuda-check: PASS|FAIL|NOT RUN ...``. Exit status 0 when every step that
ran passed, 1 when one failed, 2 when the check could not run (no CUDA, a package missing).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / ".whl"
NEEDED = ("torch", "numpy", "safetensors", "typer", "rich", "huggingface_hub", "pytest", "triton")
"""Import names of what the steps need: the project's dependencies (pyproject.toml), pytest, and triton."""
SKELETON_NEEDS = 240  # seconds the skeleton step is given at least (make ~30 s, convert ~10 s, verify the rest)


@dataclass
class Step:
    name: str
    ok: bool | None = None  # None: not run
    seconds: float = 0.0
    said: str = ""  # a few words for the summary line
    tail: str = ""  # the end of its output, for --json


@dataclass
class Run:
    mode: str  # "cuda" or "rehearse (cpu)"
    machine: dict = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)


class Clock:
    def __init__(self, budget: float) -> None:
        self.start, self.budget = time.monotonic(), budget

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.start)


def child_env(extra_path: list[str]) -> dict[str, str]:
    """The environment of every step: this tree (and wheels installed from .whl/) first on the path; the Triton
    interpreter off (on the GPU the compiled kernels are what is proven)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*extra_path, str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class Done:
    rc: int | None  # None: stopped at the budget
    stdout: str
    stderr: str
    seconds: float

    @property
    def tail(self) -> str:
        return (self.stdout + self.stderr)[-3000:]

    def failed(self, what: str) -> str:
        if self.rc is None:
            return f"{what} {'not started' if self.seconds == 0 else 'stopped'}: the budget is spent"
        return f"{what} exit {self.rc}"


def run(cmd: list, env: dict[str, str], clock: Clock) -> Done:
    """``cmd`` run from the repository root within what is left of the budget (not started once it is spent)."""
    limit = clock.left()
    if limit < 1:
        return Done(None, "", "(not started: the check's budget is spent)", 0.0)
    t = time.monotonic()
    try:
        done = subprocess.run([str(c) for c in cmd], cwd=REPO, env=env, capture_output=True, text=True, timeout=limit)
        return Done(done.returncode, done.stdout, done.stderr, time.monotonic() - t)
    except subprocess.TimeoutExpired as exc:
        out, err = (
            (b or b"").decode(errors="replace") if isinstance(b, bytes) else (b or "") for b in (exc.stdout, exc.stderr)
        )
        return Done(None, out, err + f"\n(stopped after {limit:.0f} s: the check's budget)", time.monotonic() - t)


def missing_imports() -> list[str]:
    missing = []
    for name in NEEDED:
        try:
            importlib.import_module(name)
        except Exception:  # an ImportError, or a broken install raising anything else
            missing.append(name)
    return missing


def install_wheels(site: Path) -> str:
    """Install every wheel in .whl/ into ``site`` without the network; what pip said, if it failed."""
    wheels = sorted(WHEELS.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir"]
    done = subprocess.run([*cmd, "--upgrade", "--target", str(site), *map(str, wheels)], capture_output=True, text=True)
    return "" if done.returncode == 0 else (done.stdout + done.stderr)[-500:]


def probe_machine(rehearse: bool, extra_path: list[str]) -> tuple[dict, str | None]:
    """What the machine has, and why the check cannot run (None: it can). Missing packages are installed from .whl/
    first where that folder holds wheels."""
    missing = missing_imports()
    if missing and WHEELS.is_dir() and any(WHEELS.glob("*.whl")):
        site = Path(tempfile.mkdtemp(prefix="cuda-check-site-"))
        failed = install_wheels(site)
        if failed:
            return {"missing": missing}, f"{', '.join(missing)} missing, and pip could not install .whl/: {failed}"
        sys.path.insert(0, str(site))
        extra_path.append(str(site))
        importlib.invalidate_caches()
        missing = missing_imports()
    facts: dict = {"python": sys.version.split()[0], "missing": missing}
    if "torch" in missing:
        return facts, "torch cannot be imported here (no wheels in .whl/ to install it from)"
    import torch

    facts.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    if "triton" not in missing:
        import triton

        facts["triton"] = triton.__version__
    if torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name(0)
        facts["gpus"] = torch.cuda.device_count()
    if missing:
        return facts, f"missing here: {', '.join(missing)} (carry wheels in .whl/, see docs/testing.md)"
    if rehearse:
        return facts, None
    if torch.version.cuda is None:
        return (
            facts,
            f"torch {torch.__version__} is built without CUDA: nothing to prove here (--rehearse runs the steps)",
        )
    if not torch.cuda.is_available():
        return facts, f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"
    return facts, None


def step_tests(env: dict[str, str], clock: Clock, rehearse: bool, work: Path) -> Step:
    """The tests marked cuda. On a GPU machine each must pass (a skip there is a failure: something it needs is
    missing); in a rehearsal each must be skipped, with the reason."""
    step = Step("tests")
    junit = work / "cuda-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "tests/test_cuda.py", "-m", "cuda", "-p", "no:cacheprovider", "-rs"]
    done = run([*cmd, f"--junitxml={junit}"], env, clock)
    rc, step.seconds, step.tail = done.rc, done.seconds, done.tail
    if rc is None or not junit.exists():
        step.ok, step.said = False, done.failed("tests: pytest")
        return step
    cases = list(ET.parse(junit).getroot().iter("testcase"))
    failed = [c for c in cases if c.find("failure") is not None or c.find("error") is not None]
    skipped = [c for c in cases if c.find("skipped") is not None]
    passed = len(cases) - len(failed) - len(skipped)
    step.said = f"tests {passed} passed, {len(failed)} failed, {len(skipped)} skipped"
    if rehearse:
        step.ok = rc == 0 and not failed and len(skipped) == len(cases) > 0
    else:
        step.ok = rc == 0 and not failed and not skipped and passed > 0
        if skipped:
            why = skipped[0].find("skipped").get("message", "")
            step.said += f" (a skip on a GPU machine: {why[:120]})"
    if failed:
        step.said += f" (first: {failed[0].get('name')})"
    return step


def convert_and_verify(
    name: str, src: Path, out: Path, convert_opts: list[str], env: dict[str, str], clock: Clock, device: str
) -> Step:
    """``convert SRC OUT`` then ``verify --level numeric --device DEVICE --json``: passed, the compiled kernels on the
    GPU (on the CPU in a rehearsal), 100 % coverage."""
    step = Step(name)
    ckpt = [sys.executable, "-m", "ckpt_tool"]
    done = run([*ckpt, "convert", src, out, *convert_opts, "--force", "--json"], env, clock)
    if done.rc != 0:
        return Step(name, False, done.seconds, done.failed(f"{name}: convert"), done.tail)
    kernels = ["--kernels", "auto"] if device == "cuda" else ["--kernels", "torch"]
    cmd = [*ckpt, "verify", out, "--source", src, "--level", "numeric", "--device", device, *kernels, "--json"]
    done = run(cmd, env, clock)
    rc, step.seconds, step.tail = done.rc, done.seconds, done.tail
    try:
        doc = json.loads(done.stdout or "{}")
    except json.JSONDecodeError:
        doc = {}
    numeric = doc.get("numeric") or []
    backends = sorted({f"{n.get('backend')} on {n.get('device')}" for n in numeric})
    cov = doc.get("coverage") or {}
    want_backend = "triton" if device == "cuda" else "torch"
    step.ok = (
        rc == 0
        and doc.get("ok") is True
        and bool(numeric)
        and all(n.get("backend") == want_backend and str(n.get("device")).startswith(device) for n in numeric)
        and cov.get("percent") == 100.0
    )
    first = (doc.get("failures") or [{}])[0]
    step.said = (
        f"{name}: verify numeric {'ok' if step.ok else 'FAILED'} in {step.seconds:.0f} s "
        f"({', '.join(backends) or 'no forward'}, coverage {cov.get('checked')}/{cov.get('total')})"
        + (
            ""
            if step.ok
            else f" exit {rc}" + (f", {first.get('name')}: {first.get('message', '')[:100]}" if first else "")
        )
    )
    return step


def step_fixture(env: dict[str, str], clock: Clock, work: Path, device: str) -> Step:
    src = work / "fp4"
    done = run([sys.executable, "-m", "ckpt_tool.fixtures.make", src, "--variant", "fp4"], env, clock)
    if done.rc != 0:
        return Step("fixture", False, done.seconds, done.failed("fixture: make"), done.tail)
    return convert_and_verify("fixture", src, work / "fp4-tp2", ["--tp", "2"], env, clock, device)


def step_skeleton(env: dict[str, str], clock: Clock, work: Path, device: str, reuse: Path | None) -> Step:
    if clock.left() < SKELETON_NEEDS:
        return Step(
            "skeleton", None, 0.0, f"skeleton: not run ({clock.left():.0f} s left, it is given {SKELETON_NEEDS})"
        )
    src = reuse or work / "skeleton"
    if reuse is None:
        done = run([sys.executable, "bench/make_skeleton.py", src], env, clock)
        if done.rc != 0:
            return Step("skeleton", False, done.seconds, done.failed("skeleton: make_skeleton"), done.tail)
    return convert_and_verify(
        "skeleton", src, work / "skeleton-tp8", ["--only", "mtp", "--tp", "8"], env, clock, device
    )


def summary(run_: Run, clock: Clock, why_not: str | None) -> tuple[str, int]:
    m = run_.machine
    where = m.get("gpu") or "no GPU"
    libs = f"torch {m.get('torch', '-')}" + (f", triton {m['triton']}" if m.get("triton") else "")
    took = f"{clock.budget - clock.left():.0f} s"
    if why_not:
        return f"cuda-check: NOT RUN on {where} ({libs}): {why_not}; {took}", 2
    ran = [s for s in run_.steps if s.ok is not None]
    ok = all(s.ok for s in ran) and bool(ran)
    verdict = ("PASS" if ok else "FAIL") if run_.mode == "cuda" else ("REHEARSAL OK" if ok else "REHEARSAL FAILED")
    mode = "" if run_.mode == "cuda" else " (the steps on the CPU: not a CUDA proof)"
    return f"cuda-check: {verdict}{mode} on {where} ({libs}): {'; '.join(s.said for s in run_.steps)}; {took}", (
        0 if ok else 1
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rehearse", action="store_true", help="run the steps on the CPU (no GPU needed; not a proof)")
    ap.add_argument("--no-skeleton", action="store_true", help="leave out the full-width skeleton step")
    ap.add_argument("--skeleton", type=Path, help="an existing bench/make_skeleton.py folder to use (else one is made)")
    ap.add_argument("--budget", type=float, default=480, help="seconds for the whole check (default 480)")
    ap.add_argument("--work", type=Path, help="where the fixture, skeleton and OUTs go (default: a temporary folder)")
    ap.add_argument("--json", type=Path, help="also write every step's figures and output tail here")
    args = ap.parse_args(argv)

    clock = Clock(args.budget)
    run_ = Run("rehearse (cpu)" if args.rehearse else "cuda")
    extra_path: list[str] = []
    run_.machine, why_not = probe_machine(args.rehearse, extra_path)
    work = Path(tempfile.mkdtemp(prefix="cuda-check-", dir=args.work))
    try:
        if why_not is None:
            env = child_env(extra_path)
            device = "cpu" if args.rehearse else "cuda"
            run_.steps.append(step_tests(env, clock, args.rehearse, work))
            run_.steps.append(step_fixture(env, clock, work, device))
            if not args.no_skeleton:
                run_.steps.append(step_skeleton(env, clock, work, device, args.skeleton))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    line, status = summary(run_, clock, why_not)
    for s in run_.steps:
        if s.ok is False:
            print(f"--- {s.name}: the end of its output ---\n{s.tail}\n", flush=True)
    if args.json:
        args.json.write_text(json.dumps({**asdict(run_), "summary": line, "exit": status}, indent=2) + "\n")
    print(line, flush=True)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
