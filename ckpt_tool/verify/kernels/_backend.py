"""Backend selection for the quantized GEMMs, and lazy construction of the Triton kernels.

Nothing here imports triton at module import: ``import ckpt_tool.verify.kernels`` must work on machines
without triton. Triton is imported the first time a function below needs to know about it.

How ``TRITON_INTERPRET`` works (checked on triton 3.9): the variable is read by the
``@triton.jit`` decorator each time it runs (through ``triton.knobs.runtime.interpret``, which
re-reads the environment). A kernel decorated while it is unset is a compiled ``JITFunction`` and
needs a GPU driver forever after; setting the variable later does not change it. That includes
triton.language's own ``@jit`` helpers (``tl.zeros``, ``tl.cdiv``, ``tl.sum``, ...), which are
decorated by ``import triton``: in general the variable must therefore be set before triton is
first imported. This package avoids both traps: the kernel sources are plain functions that use
only builtin ``triton.language`` ops, and :func:`get_kernel` decorates them on first use, once per
mode (compiled / interpreted), reading the mode at that moment. So setting ``TRITON_INTERPRET=1``
at any point before a GEMM call is honoured here, whether or not triton was imported already.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import torch

from ckpt_tool.checkpoint.blocks import cdiv  # grid sizes, without importing triton
from ckpt_tool.errors import UsageError

REQUESTABLE_BACKENDS: tuple[str, ...] = ("auto", "triton", "triton-interpreter", "torch")
"""Values accepted for ``backend=``."""

RESOLVED_BACKENDS: tuple[str, ...] = ("triton", "triton-interpreter", "torch")
"""Values :func:`resolve_backend` can return (what actually runs)."""

_TRUE_STRINGS = ("1", "true", "on", "yes")


@lru_cache(maxsize=1)
def triton_import_error() -> str | None:
    """Return why ``import triton`` fails, or None if triton (and triton.language) import fine."""
    try:  # triton is optional (absent on many CPU machines): never imported at module import
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:  # an ImportError, or a broken install raising anything else
        return f"{type(exc).__name__}: {exc}"
    return None


def interpreter_active() -> bool:
    """True if Triton kernels would run in the CPU interpreter (``TRITON_INTERPRET=1``) right now.

    Reads triton's own knob when available, so ``triton.knobs.runtime.interpret = True`` counts
    too; it is re-read on every call because the environment may change between calls.
    """
    if triton_import_error() is not None:
        return False
    import triton  # optional, and imported only after triton_import_error() said it imports

    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    # triton < 3.4 has no knobs; its decorator tests the variable like this.
    return os.environ.get("TRITON_INTERPRET", "0").lower() in _TRUE_STRINGS


def _cuda_ready() -> bool:
    return torch.cuda.is_available()


def available_backends() -> list[str]:
    """The backends usable in this process right now, in preference order.

    ``"triton"`` (compiled, needs triton and CUDA, and the interpreter off), ``"triton-interpreter"``
    (``TRITON_INTERPRET=1``), and ``"torch"`` (always).
    """
    found: list[str] = []
    if triton_import_error() is None:
        if interpreter_active():
            found.append("triton-interpreter")
        elif _cuda_ready():
            found.append("triton")
    found.append("torch")
    return found


def resolve_backend(requested: str, device: torch.device | str) -> str:
    """Decide which backend runs a GEMM on tensors living on ``device``; returns a resolved name.

    * ``"torch"``: dequantize with :mod:`ckpt_tool.verify.quant`, then a float32 matmul.
    * ``"auto"``: the interpreter if ``TRITON_INTERPRET=1`` is active (triton's own rule: it then
      interprets every kernel), else compiled Triton for CUDA tensors, else torch.
    * ``"triton"``: compiled Triton on CUDA tensors, or the interpreter when it is active; on a
      CPU tensor without the interpreter this raises :class:`UsageError` rather than silently
      falling back, so a caller asking for the kernels knows they did not run.
    * ``"triton-interpreter"``: the interpreter, which must be active.
    """
    if requested not in REQUESTABLE_BACKENDS:
        raise UsageError(f"unknown GEMM backend {requested!r}; choose one of {', '.join(REQUESTABLE_BACKENDS)}")
    dev = torch.device(device)
    if requested == "torch":
        return "torch"
    err = triton_import_error()
    if requested == "auto":
        if err is not None or dev.type not in ("cpu", "cuda"):
            return "torch"
        if interpreter_active():
            return "triton-interpreter"
        return "triton" if dev.type == "cuda" else "torch"
    if err is not None:
        raise UsageError(f"GEMM backend {requested!r} needs triton, which cannot be imported ({err})")
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"GEMM backend {requested!r} cannot run on {dev.type} tensors; use backend 'torch'")
    if interpreter_active():
        return "triton-interpreter"
    if requested == "triton-interpreter":
        raise UsageError("GEMM backend 'triton-interpreter' needs TRITON_INTERPRET=1 in the environment")
    if dev.type != "cuda":
        raise UsageError(
            f"GEMM backend 'triton' needs CUDA tensors, got {dev.type} tensors; set TRITON_INTERPRET=1 to "
            "run the Triton kernels in the (slow) CPU interpreter, or use backend 'torch'"
        )
    return "triton"


_KERNELS: dict[tuple[Callable[..., Any], bool], Any] = {}

LAUNCH_LOCK = threading.Lock()
"""Held around every Triton kernel call. The CPU interpreter swaps ``triton.language`` functions in and out
while a kernel runs, so two threads interpreting at once break each other ("Did you forget to add
@triton.jit?"); a compiled launch only queues work on the GPU, so holding it there costs nothing."""


def get_kernel(source: Callable[..., Any], backend: str) -> Any:
    """Return ``source`` decorated with ``triton.jit`` for the resolved ``backend``, cached.

    ``backend`` is ``"triton"`` or ``"triton-interpreter"``; it must agree with the interpreter
    mode in effect now, which is what ``triton.jit`` reads.
    """
    want_interp = backend == "triton-interpreter"
    key = (source, want_interp)
    kernel = _KERNELS.get(key)
    if kernel is None:
        if interpreter_active() != want_interp:
            raise RuntimeError(
                f"TRITON_INTERPRET changed while resolving backend {backend!r}; resolve the backend again"
            )
        import triton  # optional: only a Triton backend, resolved above, gets here

        kernel = triton.jit(source)
        _KERNELS[key] = kernel
    return kernel


def load_sources() -> Any:
    """Import and return the module holding the kernel sources (it imports triton, hence lazily)."""
    from ckpt_tool.verify.kernels import _triton_sources  # it imports triton, an optional dependency

    return _triton_sources


def gemm_tiles(m: int, n: int) -> tuple[int, int, tuple[int, int]]:
    """(BLOCK_M, BLOCK_N, grid) shared by both GEMMs: small M (few tokens per expert) gets small tiles."""
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 64
    return block_m, block_n, (cdiv(m, block_m), cdiv(n, block_n))


def dot_in_bf16(backend: str) -> bool:
    """Whether the kernels feed ``tl.dot`` bf16 operands (True) or float32 ones (False).

    The operands are exact in bf16 either way (e4m3 and e2m1 values times powers of two, and
    bf16-rounded activations), so this only picks the fastest exact path per backend. The triton
    3.9 interpreter's ``tl.dot`` multiplies bf16 operands as their raw uint16 storage (numpy has no
    bf16), giving garbage, so the interpreter gets float32 operands with ``input_precision="ieee"``.
    """
    return backend == "triton"
