"""An interrupted ``convert`` resumes to byte-identical output.

A small wrapper script runs the real CLI (``ckpt_tool.cli.entry.main``) in a subprocess with one hook
patched in, which SIGKILLs the process at a chosen point: before the N-th output file, half-way
through writing a file, just before the manifest is built, or with the manifest's temporary file
written but not yet renamed. A normal rerun must then resume (skipping the finished files) and
produce exactly the bytes of an uninterrupted conversion.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ckpt_tool.cli.entry import main

REPO = Path(__file__).resolve().parents[1]
OPTS = ["--tp", "4", "--max-shard-size", "200KB", "--workers", "1"]  # one file at a time: kill points count files
PARALLEL = ["--tp", "4", "--max-shard-size", "200KB", "--workers", "2"]
VARIANT = "fp4"

WRAPPER = textwrap.dedent(
    '''
    """Run ckpt-tool with a SIGKILL planted at one point: argv = MODE N -- CLI ARGS."""
    import json, os, signal, sys

    import ckpt_tool.output.convert as conv
    from ckpt_tool.output.writer import file_size

    mode, n = sys.argv[1], int(sys.argv[2])
    argv = sys.argv[4:]
    real_write = conv.write_output_file
    done = 0


    def die():
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


    def write(out, dest, files, sources, progress=None, *rest, **kw):
        # extra arguments (added to the library later) are passed through untouched
        global done
        if mode == "files" and done >= n:
            die()
        if mode == "midfile" and done >= n:
            half, seen = file_size(out) // 2, 0

            def progress_then_die(k):
                nonlocal seen
                seen += k
                if seen >= half:
                    die()

            real_write(out, dest, files, sources, progress_then_die, *rest, **kw)
            raise AssertionError("the file finished without reaching half its size")
        result = real_write(out, dest, files, sources, progress, *rest, **kw)
        done += 1
        return result


    conv.write_output_file = write
    if mode == "clear":  # --force on a finished OUT: die right after the first folder is removed
        real_rmtree = conv.shutil.rmtree

        def rmtree(*a, **k):
            real_rmtree(*a, **k)
            die()

        conv.shutil.rmtree = rmtree
    if mode == "manifest":
        conv.manifest_doc = lambda *a, **k: die()
    if mode == "manifest-tmp":
        real_atomic = conv._write_json_atomic

        def atomic(path, doc):
            if path.name == conv.MANIFEST:
                tmp = path.with_name(f".{path.name}.tmp")
                tmp.write_text(json.dumps(doc))
                die()
            real_atomic(path, doc)

        conv._write_json_atomic = atomic

    from ckpt_tool.cli.entry import main

    sys.exit(main(argv))
    '''
)

# (mode, N): kill before file N / half-way through file N / before the manifest / manifest tmp unrenamed
KILL_POINTS = [("files", 0), ("files", 7), ("midfile", 40), ("manifest", 0), ("manifest-tmp", 0)]


def tree_hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def part_files(out: Path) -> list[Path]:
    return sorted(p for c in ("model", "mtp") if (out / c).is_dir() for p in (out / c).glob("*.safetensors"))


def tmp_files(out: Path) -> list[Path]:
    return sorted(p for p in out.rglob("*") if p.name.endswith(".tmp"))


def run_json(capsys, *args) -> tuple[int, dict | None, str]:
    capsys.readouterr()
    code = main([str(a) for a in args] + ["--json"])
    cap = capsys.readouterr()
    try:
        doc = json.loads(cap.out)
    except json.JSONDecodeError:
        doc = None
    return code, doc, cap.err


def wrapper_cmd(root: Path, mode: str, n: int, *cli: str) -> tuple[list[str], dict]:
    wrapper = root / "kill_wrapper.py"
    if not wrapper.exists():
        wrapper.write_text(WRAPPER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return [sys.executable, str(wrapper), mode, str(n), "--", *cli], env


@pytest.fixture(scope="module")
def resume_root(tmp_path_factory, fixture_dir):
    """The source, an uninterrupted reference conversion, and every kill point's killed OUT (run in parallel)."""
    root = tmp_path_factory.mktemp("resume")
    src = fixture_dir(VARIANT)
    procs = {}
    # extra killed runs for the "different options" and "damaged finished file" tests
    points = KILL_POINTS + [("files", 5), ("files", 3)]
    for mode, n in points:
        out = root / f"killed-{mode}-{n}"
        cmd, env = wrapper_cmd(root, mode, n, "convert", str(src), str(out), *OPTS)
        procs[(mode, n)] = (
            out,
            subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE),
        )
    out = root / "killed-parallel"
    cmd, env = wrapper_cmd(root, "files", 9, "convert", str(src), str(out), *PARALLEL)
    procs[("parallel", 9)] = (
        out,
        subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE),
    )
    ref = root / "reference"
    assert main(["convert", str(src), str(ref), *OPTS]) == 0
    killed = {}
    for key, (out, p) in procs.items():
        stdout, stderr = p.communicate(timeout=600)  # 8 at once on a busy 2-core machine: only a hang takes this
        killed[key] = (out, p.returncode, stderr.decode(errors="replace"))
    return {"src": src, "ref": ref, "killed": killed, "root": root}


@pytest.mark.parametrize("mode,n", KILL_POINTS, ids=[f"{m}-{n}" for m, n in KILL_POINTS])
def test_killed_conversion_resumes_to_byte_identical_output(resume_root, capsys, mode, n) -> None:
    src, ref = resume_root["src"], resume_root["ref"]
    out, rc, stderr = resume_root["killed"][(mode, n)]
    assert rc == -signal.SIGKILL, f"the wrapper was not killed (rc={rc}):\n{stderr}"
    total = len(part_files(ref))
    assert total > 50

    # the killed run never leaves a manifest behind, complete or not
    assert not (out / "ckpt-tool.json").exists()
    finished = part_files(out)
    if mode == "files":
        assert len(finished) == n
    elif mode == "midfile":
        assert len(finished) == n
        assert [p for p in tmp_files(out) if p.name.endswith(".safetensors.tmp")], "no partial file was left"
    else:
        assert len(finished) == total
    if mode == "manifest-tmp":
        assert tmp_files(out), "the manifest's temporary file should be there"
        assert json.loads(tmp_files(out)[0].read_text())["complete"] is True  # but never renamed into place

    code, doc, err = run_json(capsys, "convert", src, out, *OPTS)
    assert code == 0, err
    assert doc["files_skipped"] == len(finished), doc
    assert doc["files_written"] == total - len(finished), doc
    assert doc["files_skipped"] + doc["files_written"] == total

    assert tmp_files(out) == []
    manifest = json.loads((out / "ckpt-tool.json").read_text())
    assert manifest["complete"] is True
    assert tree_hashes(out) == tree_hashes(ref)


def test_killed_parallel_conversion_resumes_to_byte_identical_output(resume_root, capsys) -> None:
    """Two files in flight when the kill lands (the default --workers on a multi-core machine): the finished
    ones are kept, the half-written one is redone, and the result equals an uninterrupted conversion."""
    src, ref = resume_root["src"], resume_root["ref"]
    out, rc, stderr = resume_root["killed"][("parallel", 9)]
    assert rc == -signal.SIGKILL, f"the wrapper was not killed (rc={rc}):\n{stderr}"
    assert not (out / "ckpt-tool.json").exists()
    finished = part_files(out)
    assert 0 < len(finished) < len(part_files(ref))
    code, doc, err = run_json(capsys, "convert", src, out, *PARALLEL)
    assert code == 0, err
    # a file renamed into place whose journal entry the kill cut off is redone, never trusted
    assert 0 < doc["files_skipped"] <= len(finished), doc
    assert doc["files_skipped"] + doc["files_written"] == len(part_files(ref)), doc
    assert tmp_files(out) == []
    assert tree_hashes(out) == tree_hashes(ref)


def test_killed_conversion_then_other_options_refuses_unless_force(resume_root, capsys, tmp_path) -> None:
    src = resume_root["src"]
    out, rc, stderr = resume_root["killed"][("files", 5)]
    assert rc == -signal.SIGKILL, stderr
    before = tree_hashes(out)
    other = ["--tp", "2", "--max-shard-size", "200KB"]

    code, doc, err = run_json(capsys, "convert", src, out, *other)
    assert code == 1
    assert "unfinished" in err and "--force" in err
    assert tree_hashes(out) == before
    assert not (out / "ckpt-tool.json").exists()

    # a different shard size is a different conversion too
    code, _, err = run_json(capsys, "convert", src, out, "--tp", "4", "--max-shard-size", "300KB")
    assert code == 1
    assert tree_hashes(out) == before

    code, doc, err = run_json(capsys, "convert", src, out, *other, "--force")
    assert code == 0, err
    assert doc["files_skipped"] == 0
    fresh = tmp_path / "fresh"
    assert main(["convert", str(src), str(fresh), *other]) == 0
    assert tree_hashes(out) == tree_hashes(fresh)  # no stale tp=4 files survive


def test_resume_rewrites_a_finished_file_that_was_damaged_after_the_kill(resume_root, capsys) -> None:
    """A file the journal lists as finished is re-checked (checksum), not trusted; --workers may differ."""
    src, ref = resume_root["src"], resume_root["ref"]
    out, rc, stderr = resume_root["killed"][("files", 3)]
    assert rc == -signal.SIGKILL, stderr
    finished = part_files(out)
    assert len(finished) == 3
    victim = finished[1]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF  # same size, different bytes
    victim.write_bytes(bytes(data))

    code, doc, err = run_json(capsys, "convert", src, out, *OPTS, "--workers", "2")
    assert code == 0, err
    assert doc["files_skipped"] == 2, doc
    assert tmp_files(out) == []
    assert tree_hashes(out) == tree_hashes(ref)


def test_force_killed_while_clearing_never_leaves_a_complete_manifest_over_missing_files(
    resume_root, tmp_path, capsys
) -> None:
    src, ref = resume_root["src"], resume_root["ref"]
    out = tmp_path / "out"
    shutil.copytree(ref, out)  # a finished conversion
    cmd, env = wrapper_cmd(resume_root["root"], "clear", 0, "convert", str(src), str(out), *OPTS, "--force")
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr.decode(errors="replace")
    assert not (out / "model").exists(), "the kill point was not reached"

    manifest = json.loads((out / "ckpt-tool.json").read_text()) if (out / "ckpt-tool.json").exists() else None
    if manifest is not None and manifest.get("complete"):
        missing = [rel for rel in manifest["outputs"] if not (out / rel).is_file()]
        assert not missing, f"complete manifest over {len(missing)} missing file(s), e.g. {missing[0]}"
    code, doc, err = run_json(capsys, "convert", src, out, *OPTS)
    assert code == 0, err
    assert tree_hashes(out) == tree_hashes(ref)


def test_killed_padded_conversion_resumes_to_byte_identical_output(fixture_dir, tmp_path, capsys) -> None:
    """fp4-pad at tp 4: files holding the engine's zero padding (rank 3's shared experts are zeros only) are
    journaled, skipped and finished like any other."""
    src = fixture_dir("fp4-pad")
    ref, out = tmp_path / "reference", tmp_path / "killed"
    opts = [*OPTS, "--moe-parallel", "ep"]  # its MXFP4 routed experts leave 96 rows a rank under tp 4: ep only
    assert main(["convert", str(src), str(ref), *opts]) == 0
    cmd, env = wrapper_cmd(tmp_path, "midfile", 40, "convert", str(src), str(out), *opts)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode(errors="replace")
    code, doc, err = run_json(capsys, "convert", src, out, *opts)
    assert code == 0, err
    assert doc["files_skipped"] == 40 and doc["files_skipped"] + doc["files_written"] == len(part_files(ref))
    assert tree_hashes(out) == tree_hashes(ref)
