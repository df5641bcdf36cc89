"""What one weight load costs the process that runs it: wall and CPU seconds, bytes from the disk, peak RSS.

Loaded BY PATH, standard library only, by the two places that run vLLM's loaders: ``probe.py`` (``verify --engine``)
and ``tests/engine/vllm_worker.py`` (the engine tests and ``bench/serve_load_bench.py``). Both run several loads in
one process, so every figure is a difference over the load, and the peak RSS is reset before it:

- ``seconds``: wall time; ``cpu_seconds``: user + system time of the whole process (all its threads);
- ``disk_read_bytes``: growth of ``read_bytes`` in ``/proc/self/io``, what the process made the block layer fetch
  (read-ahead and page faults on a memory-mapped file included; page-cache hits not). vLLM's loaders read
  safetensors through ``mmap``, which ``rchar`` (bytes through read()) does not see: ``read_chars`` shows it;
- ``tensor_bytes``: the bytes of every tensor the loader's weight iterator handed over (:func:`counted`): what it
  read from the files, from the disk or from the page cache;
- ``peak_rss_bytes``: ``VmHWM`` after the load, reset to the resident size before it by writing 5 to
  ``/proc/self/clear_refs`` (Linux 4.0+; ``peak_rss_reset`` false where that was refused: then it is the process's
  peak so far). It counts the file pages of a memory-mapped checkpoint the load touched, as the kernel does;
  ``rss_before_bytes`` is the resident size at the start (the interpreter, vLLM, the built model's touched pages).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

PROC_IO = Path("/proc/self/io")
PROC_STATUS = Path("/proc/self/status")
CLEAR_REFS = Path("/proc/self/clear_refs")


def _io() -> dict[str, int]:
    try:
        pairs = (line.split(":") for line in PROC_IO.read_text().splitlines())
        return {k.strip(): int(v) for k, v in pairs}
    except (OSError, ValueError):
        return {}


def _status_kib(field: str) -> int | None:
    try:
        for line in PROC_STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


class LoadMeter:
    """``with LoadMeter() as m: load()``; then ``m.figures()``. Wrap the loader's weight iterator in
    ``m.counted(...)`` to count the tensor bytes it hands over."""

    def __init__(self) -> None:
        self.tensor_bytes = 0
        self.tensors = 0
        self._figures: dict | None = None

    def counted(self, weights: Iterable) -> Iterator:
        """``weights`` (``(name, tensor)`` pairs), unchanged, counting the bytes of each tensor."""
        for name, tensor in weights:
            self.tensor_bytes += tensor.numel() * tensor.element_size()
            self.tensors += 1
            yield name, tensor

    def __enter__(self) -> LoadMeter:
        try:
            CLEAR_REFS.write_text("5")
            self._reset = True
        except OSError:
            self._reset = False
        self._rss0 = _status_kib("VmRSS")
        self._io0 = _io()
        self._cpu0 = _cpu()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        seconds = time.perf_counter() - self._t0
        cpu = _cpu() - self._cpu0
        io1 = _io()
        hwm = _status_kib("VmHWM")

        def grew(key: str) -> int | None:
            return io1[key] - self._io0[key] if key in io1 and key in self._io0 else None

        self._figures = {
            "seconds": round(seconds, 6),
            "cpu_seconds": round(cpu, 3),
            "disk_read_bytes": grew("read_bytes"),
            "read_chars": grew("rchar"),
            "tensor_bytes": self.tensor_bytes,
            "tensors": self.tensors,
            "rss_before_bytes": None if self._rss0 is None else self._rss0 * 1024,
            "peak_rss_bytes": None if hwm is None else hwm * 1024,
            "peak_rss_reset": self._reset,
        }

    def figures(self) -> dict:
        """The load's figures (see the module docstring); only after the ``with`` block."""
        assert self._figures is not None, "LoadMeter.figures() before the load ended"
        return dict(self._figures)
