"""Every broken or hostile input of ``ckpt_tool.fixtures.broken`` through the CLI: one clear line, exit 1,
nothing written.

For each case: ``inspect`` and ``convert`` (where meaningful) end with the expected exit code; a
failure prints exactly ONE ``error:`` line on stderr naming the file and tensor (where there is one)
and saying what to do, and no traceback; the source files are byte-for-byte unchanged; and OUT is
not created or touched at all, except for failures found while streaming tensor bytes, which may
leave OUT holding only the lock file, an empty journal and empty component folders (temporary
``.*.tmp`` files are removed by the writer; a rerun would clean any that survive a kill).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import run_cli, snapshot

from ckpt_tool.cli.entry import main
from ckpt_tool.fixtures.broken import CASE_SPECS, CASES, S1, S4, make_broken, patch_bytes, tensor_offset
from ckpt_tool.output.layout import JOURNAL, LOCK, MANIFEST

REPO = Path(__file__).resolve().parents[1]
# What a failure found while streaming may leave in OUT (relative to OUT); nothing else, nothing final-named.
STREAMING_LEFTOVERS = {"", LOCK, JOURNAL, "model", "mtp"}


def check_error_line(err: str, case, command: str) -> str:
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, f"{case.name} {command}: expected one stderr line, got {len(lines)}:\n{err}"
    line = lines[0]
    assert line.startswith("error: "), line
    names = (
        case.inspect_names if (command == "inspect" and case.inspect_names is not None) else (case.file, case.tensor)
    )
    for what in names:
        if what is None:
            continue
        if what == "*":  # some tensor, which one depends on plan order
            assert "tensor '" in line, f"{case.name} {command}: message names no tensor: {line}"
        else:
            assert what in line, f"{case.name} {command}: message does not name {what!r}: {line}"
    assert case.hint.lower() in line.lower(), f"{case.name} {command}: message gives no advice ({case.hint!r}): {line}"
    return line


def out_paths(case, case_dir: Path) -> Path:
    return (case_dir / case.out).resolve()


@pytest.fixture(scope="module")
def base(fixture_dir) -> Path:
    return fixture_dir("fp4")


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_case(name: str, base: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    case = CASE_SPECS[name]
    case_dir = make_broken(tmp_path / name, name, base)
    spec = json.loads((case_dir / "case.json").read_text())
    monkeypatch.chdir(case_dir)  # case.json's command lines are relative to the case folder
    src_before = snapshot(case_dir / "src")
    all_before = snapshot(case_dir)
    out = out_paths(case, case_dir)

    if case.inspect_exit is not None:
        code, stdout, err = run_cli(capsys, *spec["inspect"])
        assert code == case.inspect_exit, f"inspect exit {code}, want {case.inspect_exit}\n{err}"
        assert "Traceback" not in err + stdout
        if code == 1:
            check_error_line(err, case, "inspect")
        else:
            assert err.strip() == "", err
        assert snapshot(case_dir) == all_before, "inspect changed files"

    if case.convert_exit is not None:
        code, stdout, err = run_cli(capsys, *spec["convert"])
        assert code == case.convert_exit, f"convert exit {code}, want {case.convert_exit}\n{err}"
        assert "Traceback" not in err + stdout
        if case.warning:
            # besides the warning, only --target auto's note (no vLLM installed here) may follow
            lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("note: ")]
            warnings = [ln for ln in lines if ln.startswith("warning: ")]
            assert len(warnings) == 1 and len(lines) == 1, err
            for what in (case.file, case.tensor, case.hint):
                assert what in warnings[0], warnings[0]
            manifest = json.loads((out / MANIFEST).read_text())
            assert manifest["complete"] is True
        else:
            check_error_line(err, case, "convert")
            after = snapshot(case_dir)
            if case.writes:
                new = {p for p in after if p not in all_before}
                rel = {str(Path(p).relative_to(Path(case.out))) if p != case.out else "" for p in new}
                # several files are written at once: one another writer finished before the failure is complete
                # and journaled (a resume keeps it); nothing else but the lock, the journal and folders remains
                journal = json.loads((out / JOURNAL).read_text())
                done = {name: rec["sha256"] for name, rec in journal["files"].items()}
                assert rel - set(done) <= STREAMING_LEFTOVERS, (
                    f"unexpected files left in OUT: {sorted(rel - set(done) - STREAMING_LEFTOVERS)}"
                )
                assert all(after[str(Path(case.out) / name)] == digest for name, digest in done.items()), done
                assert {p: all_before[p] for p in all_before} == {p: after[p] for p in all_before}
            else:
                assert after == all_before, (
                    f"convert changed or created files: {sorted(set(after) ^ set(all_before))} "
                    f"changed {[p for p in all_before if p in after and after[p] != all_before[p]]}"
                )
            assert not any(p.endswith(MANIFEST) and p not in all_before for p in after)
            journaled = set()
            if case.writes and (out / JOURNAL).is_file():
                journaled = {str(Path(case.out) / n) for n in json.loads((out / JOURNAL).read_text())["files"]}
            assert not any(
                Path(p).name.startswith("model-rank-") and p not in all_before and p not in journaled for p in after
            )

    assert snapshot(case_dir / "src") == src_before, "the source changed"


def test_case_catalogue_is_big_and_described() -> None:
    assert len(CASES) >= 25
    assert all(desc for desc in CASES.values())
    assert json.loads(json.dumps(CASE_SPECS["truncated-shard"].spec()))["convert"][0] == "convert"


def test_broken_cli_writes_a_case(base: Path, tmp_path: Path) -> None:
    from ckpt_tool.fixtures.broken import main as broken_main

    assert broken_main([str(tmp_path / "c"), "--case", "trailing-bytes", "--base", str(base)]) == 0
    spec = json.loads((tmp_path / "c" / "case.json").read_text())
    assert spec["case"] == "trailing-bytes" and (tmp_path / "c" / "src" / "config.json").is_file()
    assert (tmp_path / "c" / "src" / S4).stat().st_size == (base / S4).stat().st_size + 16


@pytest.mark.parametrize("name", ["huge-int", "out-unwritable"])
def test_no_traceback_reaches_stderr_of_the_real_process(name: str, base: Path, tmp_path: Path) -> None:
    """The console script in a fresh process: one line on stderr, exit 1 (these two once crashed with a traceback)."""
    case_dir = make_broken(tmp_path / name, name, base)
    spec = json.loads((case_dir / "case.json").read_text())
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("CKPT_TOOL_DEBUG", None)
    r = subprocess.run(
        [sys.executable, "-m", "ckpt_tool", *spec["convert"]],
        cwd=case_dir,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr


def test_debug_shows_the_traceback(base: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    case_dir = make_broken(tmp_path / "c", "trailing-bytes", base)
    monkeypatch.chdir(case_dir)
    code, _, err = run_cli(capsys, "--debug", "convert", "src", "out")
    assert code == 1
    assert "Traceback" in err and "HeaderError" in err
    assert err.strip().splitlines()[-1].startswith("error: ")


def test_json_mode_error_is_one_document_and_one_line(base: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    case_dir = make_broken(tmp_path / "c", "dtype-not-string", base)
    monkeypatch.chdir(case_dir)
    for argv in (["inspect", "src", "--json"], ["convert", "src", "out", "--json"]):
        code, stdout, err = run_cli(capsys, *argv)
        assert code == 1
        doc = json.loads(stdout)
        assert doc["ok"] is False and "norm.weight" in doc["error"]
        assert len(err.strip().splitlines()) == 1


def test_source_error_after_a_finished_file_leaves_only_journaled_files(base: Path, tmp_path: Path, capsys) -> None:
    """A corrupt byte found in a LATER output file (mtp, after model's file was renamed into place).

    Documented behaviour: files finished before the failure keep their final names, are recorded
    in the journal with their sha256 (resumable state, not a finished output: no manifest), the
    failing file's temporary is removed. After re-downloading the shard a rerun resumes and the
    result equals a clean conversion byte for byte.
    """
    import shutil

    src = tmp_path / "src"
    shutil.copytree(base, src)
    shard = src / S4
    off = tensor_offset(shard, "mtp.0.ffn.experts.5.w2.scale")
    original = shard.read_bytes()[off : off + 1]
    patch_bytes(shard, off, b"\xff")
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "convert", src, out)
    assert code == 1 and "mtp.0.ffn.experts.5.w2.scale" in err and S4 in err
    assert not (out / MANIFEST).exists()
    journal = json.loads((out / JOURNAL).read_text())
    finals = sorted(str(p.relative_to(out)) for p in out.rglob("model-rank-*.safetensors"))
    assert finals == sorted(journal["files"]) == ["model/model-rank-0-part-0.safetensors"]
    for rel, entry in journal["files"].items():
        assert hashlib.sha256((out / rel).read_bytes()).hexdigest() == entry["sha256"]
    assert not list(out.rglob("*.tmp"))

    patch_bytes(shard, off, original)  # "re-download" the shard
    code, _, err = run_cli(capsys, "convert", src, out)
    assert code == 0, err
    ref = tmp_path / "ref"
    assert main(["convert", str(src), str(ref)]) == 0
    assert snapshot(out) == snapshot(ref)


def test_norm_nan_warning_survives_json_mode(base: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    case_dir = make_broken(tmp_path / "c", "bf16-norm-nan", base)
    monkeypatch.chdir(case_dir)
    code, stdout, err = run_cli(capsys, "convert", "src", "out", "--json")
    assert code == 0
    doc = json.loads(stdout)
    assert any("layers.0.attn_norm.weight" in w and S1 in w for w in doc["warnings"]), doc["warnings"]
    assert "warning: " in err


# ---------------------------------------------------------------------------------------------
# An index-named path that is there but is not a regular file: said as what it is, never opened


def _shard_replaced_by(base: Path, tmp_path: Path, kind: str) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for p in base.iterdir():
        (src / p.name).symlink_to(p)  # the fixture's files, shared; S4 below is the case's own
    (src / S4).unlink()
    if kind == "folder":
        (src / S4).mkdir()
    else:
        os.mkfifo(src / S4)
    return src


@pytest.mark.parametrize(("kind", "said"), [("folder", "is a folder"), ("pipe", "is a named pipe")])
def test_an_index_named_path_that_is_not_a_regular_file_is_named_as_what_it_is(
    kind: str, said: str, base: Path, tmp_path: Path
) -> None:
    """A real process (a named pipe opened for reading would block it: the timeout would fail the test; 300 s, so
    only a hang reaches it on a busy machine)."""
    src = _shard_replaced_by(base, tmp_path, kind)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("CKPT_TOOL_DEBUG", None)
    for command in (["inspect", str(src)], ["convert", str(src), str(tmp_path / "out")]):
        r = subprocess.run(
            [sys.executable, "-m", "ckpt_tool", *command], capture_output=True, text=True, env=env, timeout=300
        )
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1, r.stderr
        assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
        assert S4 in lines[0] and said in lines[0] and "missing" not in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


def test_an_index_named_path_that_is_absent_is_missing(base: Path, tmp_path: Path, capsys) -> None:
    src = _shard_replaced_by(base, tmp_path, "folder")
    (src / S4).rmdir()
    code, _out, err = run_cli(capsys, "inspect", src)
    assert code == 1 and S4 in err and "missing" in err
