"""Install one vLLM release (the real wheel, no dependencies) and the few packages its DeepSeek V4 model and loader
modules import into ``<repo>/.engine-site/vllm-<release>/`` (gitignored), for tests/engine/vllm_worker.py.

    python tests/engine/install.py                   # every release a profile is verified against (idempotent)
    python tests/engine/install.py 0.34.0 [--force]  # one release

Each release installs from its own pinned requirements file, ``tests/engine/requirements/vllm-<release>.txt``,
with ``pip install --no-deps --target``: the project venv keeps its own torch (2.13.0 CPU; vLLM 0.33 declares
torch==2.13.0 and 0.34 torch==2.14.0, neither of which is installed here), numpy, safetensors, pydantic,
huggingface_hub, tqdm, ... Each pin is what ``import vllm.models.deepseek_v4.nvidia.{model,mtp}`` plus vLLM's config,
registry and loader modules import at module level (checked by blocking each one in turn), at versions that satisfy
that release's own ``Requires-Dist`` where it names one. pip's cache makes a reinstall cheap; without network and
cache the install fails, and so must the tests that need it.

``ENGINE_WHEELS=DIR`` lets pip take the vLLM wheels (and any pinned package) from a local folder of wheels first.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SITES = REPO / ".engine-site"
REQUIREMENTS = HERE / "requirements"
MARKER = ".installed.json"
LOCK = ".lock"


def site_of(release: str, root: Path = SITES) -> Path:
    return Path(root) / f"vllm-{release}"


def requirements_of(release: str) -> Path:
    path = REQUIREMENTS / f"vllm-{release}.txt"
    if not path.is_file():
        raise RuntimeError(
            f"no {path.relative_to(REPO)}: a profile is verified against vLLM {release} but the engine matrix has no "
            "pinned requirements for it; copy the previous release's file, set its vllm== pin and check the other pins "
            "against the wheel's Requires-Dist (docs/adding-a-vllm-release.md)"
        )
    return path


def pins_of(release: str) -> list[str]:
    """The requirement lines of ``release``'s file (comments and blank lines dropped)."""
    lines = [line.split("#", 1)[0].strip() for line in requirements_of(release).read_text().splitlines()]
    pins = [line for line in lines if line]
    if f"vllm=={release}" not in pins:
        raise RuntimeError(f"{requirements_of(release)} does not pin vllm=={release}")
    return pins


def _wanted(release: str) -> dict:
    return {
        "release": release,
        "pins": pins_of(release),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }


def installed(release: str, site: Path) -> bool:
    """True when ``site`` holds a finished install of exactly ``release``'s pins."""
    try:
        have = json.loads((site / MARKER).read_text())
    except (OSError, ValueError):
        return False
    want = _wanted(release)
    return all(have.get(k) == v for k, v in want.items()) and (site / "vllm" / "__init__.py").is_file()


def _pip_args(release: str, site: Path) -> list[str]:
    wheels = os.environ.get("ENGINE_WHEELS")
    return [
        sys.executable, "-m", "pip", "install",
        "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "--no-input",
        *(["--find-links", str(Path(wheels).resolve())] if wheels else []),
        "--target", str(site),
        "-r", str(requirements_of(release)),
    ]  # fmt: skip


def ensure_installed(release: str, site: Path | None = None, *, force: bool = False, log=None) -> Path:
    """Install ``release`` (once) and return its site folder; raise RuntimeError with pip's output when it cannot."""
    site = Path(site) if site is not None else site_of(release)
    site.mkdir(parents=True, exist_ok=True)
    with open(site / LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one installer at a time (pytest-xdist, two shells)
        if not force and installed(release, site):
            return site
        for entry in site.iterdir():  # start clean: a half-finished install has no marker
            if entry.name == LOCK:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        t0 = time.perf_counter()
        proc = subprocess.run(_pip_args(release, site), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(
                f"pip could not install vLLM {release} into {site} (exit {proc.returncode}):\n"
                + (proc.stdout[-4000:] + proc.stderr[-4000:])
            )
        if not (site / "vllm" / "__init__.py").is_file():
            raise RuntimeError(f"pip finished but {site}/vllm is missing:\n{proc.stdout[-4000:]}")
        (site / MARKER).write_text(
            json.dumps({**_wanted(release), "seconds": round(time.perf_counter() - t0, 1)}, indent=1) + "\n"
        )
        if log:
            log(f"installed vLLM {release} into {site} in {time.perf_counter() - t0:.1f} s")
        return site


def verified_releases() -> list[str]:
    """Every vLLM release a profile is verified against (the matrix's columns), from ckpt_tool.mapping.profiles."""
    sys.path.insert(0, str(REPO))
    from ckpt_tool.mapping.profiles import verified_releases as pairs

    return sorted({release for release, _ in pairs()}, key=lambda v: tuple(int(x) for x in v.split(".")))


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("releases", nargs="*", help="vLLM releases (default: every verified one)")
    p.add_argument("--root", default=str(SITES), help="folder of the per-release site folders")
    p.add_argument("--force", action="store_true")
    args = p.parse_args(argv)
    for release in args.releases or verified_releases():
        t0 = time.perf_counter()
        try:
            site = ensure_installed(release, site_of(release, Path(args.root)), force=args.force, log=print)
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return 1
        print(f"{site}: ready ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
