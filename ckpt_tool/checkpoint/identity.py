"""Which file a source path is, and whether it is still that file: size, mtime_ns, inode and device.

convert records each source file's identity when it reads its header (the plan is made from that
header) and checks it again before it finishes a file of OUT that the source file fed and before the
manifest says complete, as tar and rsync report a "file changed as we read it": another download
finishing into the same folder, an ``hf download`` updating a snapshot, a copy still in progress.

Two ways to compare, for two questions:

- :meth:`FileIdentity.changes`: is it the same file here and now (one run, one machine)? All four
  fields. An in-place write moves mtime (and maybe size); a new file renamed over the path has
  another inode.
- :meth:`FileIdentity.changes_since`: is it the same content as a record made by another run,
  perhaps on another machine (a journal entry, the manifest)? Size and mtime_ns, rsync's quick check:
  the device number of one NFS mount differs between machines, and a copy that keeps its times
  (``cp -a``, ``rsync -a``) has another inode but the same bytes.

Neither sees a write that puts the old mtime back (``touch -d``) or lands within the file system's
timestamp tick of the recorded stat; ``verify --level values`` compares every byte.
"""

from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

from ckpt_tool.errors import CheckpointError


class FileIdentity(NamedTuple):
    size: int
    mtime_ns: int
    inode: int
    device: int

    @classmethod
    def of_stat(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)

    @classmethod
    def from_dict(cls, doc: dict) -> FileIdentity | None:
        """A journal's or manifest's record; None when it is not one (an earlier version's, a torn one)."""
        try:
            return cls(*(int(doc[k]) for k in cls._fields))
        except (KeyError, TypeError, ValueError):
            return None

    def as_dict(self) -> dict[str, int]:
        return self._asdict()

    def changes(self, now: FileIdentity) -> list[str]:
        """How ``now`` differs from this identity, in words (empty: the same file, unchanged)."""
        said = self.changes_since(now)
        if self.inode != now.inode or self.device != now.device:
            said.append(
                f"replaced by another file (inode {self.inode} on device {self.device} → inode {now.inode} on device "
                f"{now.device})"
            )
        return said

    def changes_since(self, now: FileIdentity) -> list[str]:
        """How ``now`` differs in size or modification time (empty: the same by rsync's quick check)."""
        said = []
        if self.size != now.size:
            said.append(f"size {self.size} → {now.size} bytes")
        if self.mtime_ns != now.mtime_ns:
            said.append(f"modified at {_when(now.mtime_ns)} (was {_when(self.mtime_ns)})")
        return said


def _when(ns: int) -> str:
    seconds, rest = divmod(ns, 1_000_000_000)
    stamp = datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{stamp}.{rest:09d}Z"


def identity_of(path: Path) -> FileIdentity | None:
    """The identity of the file at ``path`` now (symlinks followed, as reading does); None: nothing is there."""
    try:
        return FileIdentity.of_stat(os.stat(path))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot stat ({exc.strerror or exc}); check the file") from None


def changed_while_converting(path: Path, recorded: FileIdentity) -> CheckpointError | None:
    """The error for a source file that is no longer the one the plan was made from (None: unchanged)."""
    now = identity_of(path)
    said = ["removed"] if now is None else recorded.changes(now)
    if not said:
        return None
    return CheckpointError(
        f"{path}: changed while converting ({'; '.join(said)}); OUT is not complete — rerun the same command once the "
        "source is stable: it converts again only what this file fed"
    )
