"""Reading byte ranges of checkpoint files: each file opened once, read-only, read positionally.

One home for what convert's writer, verify's values and numeric levels and unconvert all do: keep a
descriptor per file (``pread`` is positional, so threads share them), read exactly the bytes asked for,
and turn an OS error or a short read into a :class:`CheckpointError` naming the file (and the tensor).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from ckpt_tool.errors import CheckpointError


class OpenFiles:
    """Read-only descriptors of files under ``root`` (or of absolute paths), opened on first use.

    ``sequential``: the files are read mostly front to back (convert), so the kernel may read ahead further.
    """

    def __init__(self, root: Path | None = None, *, sequential: bool = False) -> None:
        self.root = root
        self.sequential = sequential
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()

    def fd(self, file: str | Path) -> int:
        path = Path(file) if self.root is None else self.root / file
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                try:
                    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                except OSError as exc:
                    raise CheckpointError(f"{path}: cannot be opened for reading ({exc.strerror})") from None
                if self.sequential and hasattr(os, "posix_fadvise"):
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                    except OSError:
                        pass
                self._fds[path] = fd
            return fd

    def read_into(self, file: str | Path, into: memoryview, offset: int, *, what: str = "") -> None:
        """Fill ``into`` from byte ``offset`` of ``file``; a short read means the file was truncated or changed."""
        fd = self.fd(file)
        got = 0
        while got < len(into):
            try:
                n = os.preadv(fd, [into[got:]], offset + got)
            except OSError as exc:
                raise CheckpointError(f"{file}: {what + ': ' if what else ''}cannot be read ({exc.strerror})") from None
            if n == 0:
                raise CheckpointError(
                    f"{file}: {what + ': ' if what else ''}file ended early at byte {offset + got}; was it truncated "
                    "or modified?"
                )
            got += n

    def read(self, file: str | Path, offset: int, n: int, *, what: str = "") -> bytearray:
        """Exactly ``n`` bytes from byte ``offset`` of ``file``."""
        buf = bytearray(n)
        self.read_into(file, memoryview(buf), offset, what=what)
        return buf

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self) -> OpenFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
