"""Rows of safetensors tensors read with ``pread``, for the numeric level.

A tensor is seen as 2-D ``[prod(shape[:-1]), shape[-1]]`` (a stacked expert ``e`` of ``[E, N, K]`` is rows
``e*N .. (e+1)*N``). Reads go straight into a fresh torch buffer: no mmap, whose touched pages would
count against RSS for the whole checkpoint, and never more than the rows asked for. FP8, E8M0 and
packed FP4 bytes come back as ``uint8`` (the quant functions and kernels take raw bytes).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ckpt_tool.checkpoint.files import OpenFiles
from ckpt_tool.checkpoint.headers import TensorInfo
from ckpt_tool.checkpoint.source import Checkpoint
from ckpt_tool.errors import CheckpointError

TORCH_DTYPES: dict[str, torch.dtype] = {
    "F8_E4M3": torch.uint8,
    "F8_E8M0": torch.uint8,
    "I8": torch.uint8,
    "U8": torch.uint8,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "I64": torch.int64,
    "I32": torch.int32,
}


def source_info(ckpt: Checkpoint, name: str) -> TensorInfo:
    """The header of source tensor ``name`` (DeepSeek's name); CheckpointError if the checkpoint lacks it."""
    info = ckpt.tensors.get(name)
    if info is None:
        raise CheckpointError(f"source tensor {name!r} is not in the checkpoint")
    return info


def row_count(info: TensorInfo) -> int:
    """Rows of the 2-D view of ``info``."""
    return math.prod(info.shape[:-1]) if len(info.shape) > 1 else 1


TRIM_EVERY_BYTES = 256 * 1024 * 1024


def _malloc_trim():
    """glibc's ``malloc_trim`` (None elsewhere)."""
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc); a no-op elsewhere. Called between verify stages."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class RowReader:
    """Reads row ranges of tensors; each file is opened once, read-only, and closed by :meth:`close`.

    Every ``TRIM_EVERY_BYTES`` read it hands freed heap pages back to the OS: tiles of a few MiB freed
    between small long-lived tensors fragment glibc's heap, and without this the resident size of a
    full-width layer's forward climbs to GBs although the live data stay at tile size.
    """

    def __init__(self) -> None:
        self._files = OpenFiles()
        self._since_trim = 0
        self._trim = _malloc_trim()

    def rows(self, path: Path, info: TensorInfo, r0: int, r1: int) -> torch.Tensor:
        """Rows ``[r0, r1)`` of ``info`` (in file ``path``) as a ``[r1 - r0, last dim]`` tensor."""
        dtype = TORCH_DTYPES.get(info.dtype)
        if dtype is None:
            raise CheckpointError(
                f"{path}: tensor {info.name!r} has dtype {info.dtype}, which the numeric level does not read"
            )
        cols = info.shape[-1] if info.shape else 1
        row_bytes = cols * torch.tensor([], dtype=dtype).element_size()
        if not 0 <= r0 <= r1 <= row_count(info):
            raise CheckpointError(f"{path}: tensor {info.name!r}: rows {r0}:{r1} outside its {row_count(info)} rows")
        n = (r1 - r0) * row_bytes
        buf = torch.empty(n, dtype=torch.uint8)
        self._files.read_into(path, memoryview(buf.numpy()), info.start + r0 * row_bytes, what=f"tensor {info.name!r}")
        self._since_trim += n
        if self._since_trim >= TRIM_EVERY_BYTES and self._trim is not None:
            self._since_trim = 0
            self._trim(0)
        return buf.view(dtype).view(r1 - r0, cols)

    def source_rows(self, ckpt: Checkpoint, name: str, r0: int, r1: int) -> torch.Tensor:
        """Rows ``[r0, r1)`` of source tensor ``name`` of ``ckpt``."""
        info = source_info(ckpt, name)
        return self.rows(ckpt.root / info.file, info, r0, r1)

    def whole(self, path: Path, info: TensorInfo) -> torch.Tensor:
        """The whole tensor in its own shape (for the small ones: norms, hc_*, sinks, biases, tables)."""
        return self.rows(path, info, 0, row_count(info)).reshape(info.shape)

    def close(self) -> None:
        self._files.close()

    def __enter__(self) -> RowReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
