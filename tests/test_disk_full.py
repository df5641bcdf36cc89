"""Disk full (ENOSPC) during convert: one clear line, nothing that looks finished, and a rerun that resumes.

ENOSPC is injected for files under OUT only, at every level a writer may use: Python file objects
(``open``/``io.open``), ``os.write``/``pwrite``/``writev``/``pwritev``, ``copy_file_range``,
``sendfile`` and ``posix_fallocate``. Each test asserts the injection really fired, so a writer that
starts writing some other way fails here loudly instead of passing untested.

After the failure: exit 1 and one ``error:`` line that mentions space; no ``ckpt-tool.json``; every
final-named ``model-rank-*`` file holds exactly the bytes a clean conversion writes (a partial file
never carries a final name; the journal lists it unless the journal write itself hit ENOSPC, in
which case the rerun rewrites it); anything partial is left only under a temporary ``.NAME.tmp``
name, which the rerun removes or replaces. Then a normal rerun succeeds, leaves no temporary or journal behind, and OUT
equals a clean conversion byte for byte.
"""

from __future__ import annotations

import builtins
import errno
import hashlib
import io
import json
import os
import threading
from pathlib import Path

import pytest
from cli_helpers import snapshot

from ckpt_tool.cli.entry import main
from ckpt_tool.output.layout import JOURNAL, MANIFEST

OPTS = ["--tp", "2", "--max-shard-size", "2MB"]


class DiskFull:
    """ENOSPC for writes into ``out``: after ``budget`` bytes, on the Nth fallocate, or on the Nth open of a name."""

    def __init__(
        self,
        out: Path,
        *,
        budget: int | None = None,
        fallocate_fail_at: int | None = None,
        fail_open: tuple[str, int] | None = None,
    ) -> None:
        self.out = str(out.resolve()) + os.sep
        self.left = budget
        self.fallocate_fail_at = fallocate_fail_at
        self.fallocates = 0
        self.fail_open = fail_open
        self.opens: dict[str, int] = {}
        self.injected = 0
        self.lock = threading.Lock()

    def ours(self, path: object) -> bool:
        try:
            return os.path.abspath(os.fspath(path)).startswith(self.out)
        except TypeError:
            return False

    def ours_fd(self, fd: int) -> bool:
        try:
            return os.readlink(f"/proc/self/fd/{fd}").startswith(self.out)
        except OSError:
            return False

    def full(self, path: object = None) -> OSError:
        self.injected += 1
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), None if path is None else os.fspath(path))

    def charge(self, n: int, path: object = None) -> int:
        """Bytes of an ``n``-byte write that still fit; raises ENOSPC when none do."""
        with self.lock:
            if self.left is None:
                return n
            if self.left <= 0:
                raise self.full(path)
            k = min(n, self.left)
            self.left -= k
            return k

    # --- patches -------------------------------------------------------------------------------

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        real_open = builtins.open
        disk = self

        def fake_open(file, mode="r", *args, **kwargs):
            fh = real_open(file, mode, *args, **kwargs)
            if not isinstance(file, int) and any(c in mode for c in "wax+") and disk.ours(file):
                name = Path(os.fspath(file)).name
                with disk.lock:
                    disk.opens[name] = disk.opens.get(name, 0) + 1
                    doomed = disk.fail_open is not None and disk.fail_open == (name, disk.opens[name])
                return _File(fh, disk, file, doomed)
            return fh

        monkeypatch.setattr(builtins, "open", fake_open)
        monkeypatch.setattr(io, "open", fake_open)

        def wrap_fd_write(name: str, size_of):
            real = getattr(os, name)

            def fake(fd, data, *rest):
                if disk.ours_fd(fd):
                    n = size_of(data)
                    k = disk.charge(n)
                    if k < n:
                        raise disk.full()
                return real(fd, data, *rest)

            monkeypatch.setattr(os, name, fake)

        nbytes = lambda b: memoryview(b).nbytes  # noqa: E731
        wrap_fd_write("write", nbytes)
        wrap_fd_write("pwrite", nbytes)
        wrap_fd_write("writev", lambda bufs: sum(memoryview(b).nbytes for b in bufs))
        wrap_fd_write("pwritev", lambda bufs: sum(memoryview(b).nbytes for b in bufs))

        real_cfr = os.copy_file_range

        def fake_cfr(src, dst, count, *rest):
            if disk.ours_fd(dst):
                count = disk.charge(count)
            return real_cfr(src, dst, count, *rest)

        monkeypatch.setattr(os, "copy_file_range", fake_cfr)
        real_sendfile = os.sendfile

        def fake_sendfile(out_fd, in_fd, offset, count, *rest, **kw):
            if disk.ours_fd(out_fd):
                count = disk.charge(count)
            return real_sendfile(out_fd, in_fd, offset, count, *rest, **kw)

        monkeypatch.setattr(os, "sendfile", fake_sendfile)
        real_fallocate = os.posix_fallocate

        def fake_fallocate(fd, offset, length):
            if disk.ours_fd(fd):
                with disk.lock:
                    disk.fallocates += 1
                    n = disk.fallocates
                if disk.fallocate_fail_at is not None and n >= disk.fallocate_fail_at:
                    raise disk.full()
                if disk.left is not None:  # a budget: behave like a file system without fallocate
                    raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
            return real_fallocate(fd, offset, length)

        monkeypatch.setattr(os, "posix_fallocate", fake_fallocate)


class _File:
    """A file object whose writes are charged against the disk's budget."""

    def __init__(self, fh, disk: DiskFull, path, doomed: bool) -> None:
        self._fh, self._disk, self._path, self._doomed = fh, disk, path, doomed

    def write(self, data):
        if self._doomed:
            raise self._disk.full(self._path)
        n = len(data) if isinstance(data, str) else memoryview(data).nbytes
        k = self._disk.charge(n, self._path)
        if k < n:
            self._fh.write(data[:k] if isinstance(data, str) else memoryview(data).cast("B")[:k])
            raise self._disk.full(self._path)
        return self._fh.write(data)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._fh.close()

    def __getattr__(self, name):
        return getattr(self._fh, name)


@pytest.fixture(scope="module")
def clean(fixture_dir, tmp_path_factory) -> tuple[Path, dict[str, str]]:
    src = fixture_dir("fp4")
    ref = tmp_path_factory.mktemp("diskfull") / "ref"
    assert main(["convert", str(src), str(ref), *OPTS]) == 0
    return src, snapshot(ref)


def check_failed_state(out: Path, err: str, want: dict[str, str]) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "space" in lines[0], lines[0]
    assert "Traceback" not in err
    assert not (out / MANIFEST).exists(), "a manifest after a failed conversion"
    journal = json.loads((out / JOURNAL).read_text()) if (out / JOURNAL).exists() else {"files": {}}
    for p in out.rglob("*"):
        rel = str(p.relative_to(out))
        if p.name.startswith("model-rank-"):
            # a final name only ever holds a finished file (the same bytes a clean run writes); the
            # journal may not list it when the journal write itself hit ENOSPC: the rerun rewrites it then
            digest = hashlib.sha256(p.read_bytes()).hexdigest()
            assert digest == want[rel], f"{rel}: final-named but not the finished file"
            entry = journal["files"].get(rel)
            assert entry is None or entry["sha256"] == digest, f"{rel}: journal and file disagree"
        elif p.name.endswith(".tmp"):
            assert p.name.startswith("."), f"{rel}: a temporary that is not hidden"


SCENARIOS = {
    # name: (DiskFull kwargs, workers)
    "write-mid-second-file": ({"budget": 3_500_000}, 1),
    "write-mid-file-2-workers": ({"budget": 3_500_000}, 2),
    "nothing-fits": ({"budget": 0}, 1),
    "fallocate-third-file": ({"fallocate_fail_at": 3}, 1),
    "journal-after-first-file": ({"fail_open": (f".{JOURNAL}.tmp", 2)}, 1),
    "manifest": ({"fail_open": (f".{MANIFEST}.tmp", 1)}, 1),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_disk_full_then_rerun_equals_clean(scenario: str, clean, tmp_path: Path, capsys, monkeypatch) -> None:
    src, want = clean
    kwargs, workers = SCENARIOS[scenario]
    out = tmp_path / "out"
    disk = DiskFull(out, **kwargs)
    with monkeypatch.context() as m:
        disk.install(m)
        capsys.readouterr()
        code = main(["convert", str(src), str(out), *OPTS, "--workers", str(workers)])
        err = capsys.readouterr().err
    assert disk.injected > 0, "ENOSPC was never injected: the writer writes through a path this test does not patch"
    assert code == 1, err
    check_failed_state(out, err, want)
    if os.environ.get("DISK_FULL_REPORT"):
        with capsys.disabled():
            left = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
            print(f"\n{scenario}: {err.strip()}\n  left in OUT: {left}")

    capsys.readouterr()
    code = main(["convert", str(src), str(out), *OPTS])
    err = capsys.readouterr().err
    assert code == 0, err
    assert not list(out.rglob("*.tmp")) and not (out / JOURNAL).exists()
    assert snapshot(out) == want, "rerun after ENOSPC differs from a clean conversion"
