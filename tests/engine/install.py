"""Install vLLM 0.33.0 (the real wheel, no dependencies) and the few packages its DeepSeek V4 model and loader
modules import into ``<repo>/.engine-site`` (gitignored), for tests/engine/vllm_worker.py.

    python tests/engine/install.py            # idempotent: skips when the marker lists exactly these pins
    python tests/engine/install.py --force    # reinstall

``pip install --no-deps --target`` with exact pins: the project venv keeps its own torch (2.13.0 CPU; vLLM 0.33
declares torch==2.14, which is never installed here), numpy, safetensors, pydantic, huggingface_hub, tqdm, ...
Each pin below is what ``import vllm.models.deepseek_v4.nvidia.{model,mtp}`` plus vLLM's config, registry and
loader modules import at module level (checked by blocking each one in turn); versions satisfy vLLM 0.33.0's own
``Requires-Dist`` where it names one. pip's cache makes a reinstall cheap; without network and cache the install
fails, and so must the tests that need it.

``ENGINE_VLLM_WHEEL=/path/vllm-0.33.0-*.whl`` installs that file instead of downloading ``vllm==0.33.0``.
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

REPO = Path(__file__).resolve().parents[2]
SITE = REPO / ".engine-site"
MARKER = ".installed.json"
LOCK = ".lock"

VLLM_PIN = "vllm==0.33.0"
PINS: tuple[str, ...] = (
    VLLM_PIN,
    # vLLM's config and model classes (DeepseekV4Config, tokenizer types)
    "transformers==5.20.2",
    "tokenizers==0.23.3",
    # imported at module level across vllm.{utils,config,distributed,v1,multimodal,...}
    "regex==2026.11.19",
    "cbor2==6.3.0",
    "psutil==7.2.2",
    "pyzmq==27.3.0",
    "msgspec==0.23.0",
    "cloudpickle==3.1.3",
    "cachetools==8.0.2",
    "py-cpuinfo==9.0.0",
    "pybase64==1.5.1",
    "prometheus_client==0.26.0",
    "pillow==13.0.0",
    "einops==0.8.2",
    "uvloop==0.23.0",
    # vllm.connections (via vllm.config.model -> assets)
    "requests==2.34.2",
    "urllib3==2.8.0",
    "certifi==2026.10.19.post1",
    "aiohttp==3.14.5",
    "multidict==7.2.1",
    "yarl==1.25.1",
    "propcache==0.5.4",
    "aiohappyeyeballs==2.7.1",
    "aiosignal==1.4.0",
    "frozenlist==1.8.0",
    "attrs==26.1.0",
    # vllm.v1.request -> structured output / parsers / OpenAI protocol types
    "openai==3.57.0",
    "sniffio==1.3.1",
    "oss-harmony==0.0.11",
    "fastapi==0.136.3",
    "starlette==1.10.0",
    "partial-json-parser==0.2.1.1.post7",
    "llguidance==1.7.6",
    "xgrammar==0.2.8",
    "apache-tvm-ffi==0.1.11",
    # quantization registry (quark -> int_wna16 oracle)
    "compressed-tensors==0.17.0",
    "loguru==0.7.3",
)


def _wanted() -> dict:
    wheel = os.environ.get("ENGINE_VLLM_WHEEL")
    return {
        "pins": list(PINS),
        "vllm_wheel": Path(wheel).name if wheel else None,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }


def installed(site: Path = SITE) -> bool:
    """True when ``site`` holds a finished install of exactly these pins."""
    try:
        have = json.loads((site / MARKER).read_text())
    except (OSError, ValueError):
        return False
    want = _wanted()
    return all(have.get(k) == v for k, v in want.items()) and (site / "vllm" / "__init__.py").is_file()


def _pip_args(site: Path) -> list[str]:
    pins = list(PINS)
    wheel = os.environ.get("ENGINE_VLLM_WHEEL")
    if wheel:
        if not Path(wheel).name.startswith("vllm-0.33.0-"):
            raise RuntimeError(f"ENGINE_VLLM_WHEEL must be a vllm 0.33.0 wheel, got {wheel}")
        pins[pins.index(VLLM_PIN)] = str(Path(wheel).resolve())
    return [
        sys.executable, "-m", "pip", "install",
        "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "--no-input",
        "--target", str(site),
        *pins,
    ]  # fmt: skip


def ensure_installed(site: Path = SITE, *, force: bool = False, log=None) -> Path:
    """Install (once) and return the site folder; raise RuntimeError with pip's output when it cannot."""
    site = Path(site)
    site.mkdir(parents=True, exist_ok=True)
    with open(site / LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one installer at a time (pytest-xdist, two shells)
        if not force and installed(site):
            return site
        for entry in site.iterdir():  # start clean: a half-finished install has no marker
            if entry.name == LOCK:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        t0 = time.perf_counter()
        proc = subprocess.run(_pip_args(site), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(
                f"pip could not install the vLLM 0.33.0 engine into {site} (exit {proc.returncode}):\n"
                + (proc.stdout[-4000:] + proc.stderr[-4000:])
            )
        if not (site / "vllm" / "__init__.py").is_file():
            raise RuntimeError(f"pip finished but {site}/vllm is missing:\n{proc.stdout[-4000:]}")
        (site / MARKER).write_text(
            json.dumps({**_wanted(), "seconds": round(time.perf_counter() - t0, 1)}, indent=1) + "\n"
        )
        if log:
            log(f"installed vLLM 0.33.0 engine into {site} in {time.perf_counter() - t0:.1f} s")
        return site


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--site", default=str(SITE))
    p.add_argument("--force", action="store_true")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        site = ensure_installed(Path(args.site), force=args.force, log=print)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    print(f"{site}: ready ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
