"""Scale-out: ``--ranks``, ``--shard-index K --shard-count M`` into one shared OUT, then ``--finalize``."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import run_cli

from ckpt_tool.checkpoint.source import open_checkpoint
from ckpt_tool.cli.entry import main
from ckpt_tool.errors import UsageError
from ckpt_tool.mapping.plan import Options
from ckpt_tool.mapping.planner import plan_conversion
from ckpt_tool.mapping.selection import parse_ranks, select_files
from ckpt_tool.output.convert import convert
from ckpt_tool.verify.levels import verify

REPO = Path(__file__).resolve().parents[1]
OPTS = ["--tp", "2", "--max-shard-size", "300KB"]
PART_RE = re.compile(r"^model-rank-(\d+)-part-(\d+)\.safetensors$")


def tree_hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def part_files(out: Path) -> list[str]:
    return sorted(
        f"{c}/{p.name}" for c in ("model", "mtp") if (out / c).is_dir() for p in (out / c).glob("*.safetensors")
    )


def run(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def reference(fixture_dir, tmp_path_factory):
    """A single-machine conversion with OPTS (the byte-for-byte reference)."""
    out = tmp_path_factory.mktemp("ref") / "out"
    assert main(["convert", str(fixture_dir("fp4-2mtp")), str(out), *OPTS]) == 0
    return out


def test_parse_ranks() -> None:
    assert parse_ranks("0,3-5") == (0, 3, 4, 5)
    assert parse_ranks("2") == (2,)
    assert parse_ranks("5-5,1,1") == (1, 5)
    for bad in ("", "a", "3-1", "1,,2", "-1"):
        with pytest.raises(UsageError):
            parse_ranks(bad)


@pytest.mark.parametrize("ranks", [None, (0,), (1, 3)])
@pytest.mark.parametrize("count", [1, 2, 3, 5, 8, 1000])
def test_shards_partition_the_planned_files_exactly_once(fixture_dir, count: int, ranks) -> None:
    ckpt = open_checkpoint(fixture_dir("fp4"))
    plan = plan_conversion(ckpt.require_config(), ckpt.tensors, Options(tp=4, max_shard_size=200 * 1024))
    want = [f.relpath for f in plan.files if ranks is None or f.rank in ranks]
    assert len(want) > 8
    seen: list[str] = []
    for k in range(count):
        part = [f.relpath for f in select_files(plan, ranks, k, count)]
        assert part == [f.relpath for f in select_files(plan, ranks, k, count)]  # deterministic
        seen += part
    assert sorted(seen) == sorted(want) and len(seen) == len(set(seen))


def test_three_shards_then_finalize_equal_a_single_machine_conversion(fixture_dir, reference, tmp_path, capsys) -> None:
    src, out = fixture_dir("fp4-2mtp"), tmp_path / "out"
    written: list[str] = []
    for k in range(3):
        code, err = run(capsys, "convert", src, out, *OPTS, "--shard-index", k, "--shard-count", 3, "--json")
        assert code == 0, err
        assert not (out / "ckpt-tool.json").exists(), "a shard must not write the manifest"
        assert (out / f".ckpt-tool-journal-{k}-of-3.json").is_file()
        now = part_files(out)
        assert not set(written) - set(now)
        new = sorted(set(now) - set(written))
        assert new, f"shard {k} wrote nothing"
        written = now
    assert not (out / "model" / "index.json").exists()
    code, err = run(capsys, "convert", src, out, *OPTS, "--finalize")
    assert code == 0, err
    assert tree_hashes(out) == tree_hashes(reference)
    assert verify(out, src, level="values").ok
    # finalizing again is a no-op
    code, err = run(capsys, "convert", src, out, *OPTS, "--finalize")
    assert code == 0, err
    assert tree_hashes(out) == tree_hashes(reference)


def test_shards_run_concurrently_into_one_out(fixture_dir, reference, tmp_path) -> None:
    src, out = fixture_dir("fp4-2mtp"), tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ckpt_tool",
                "convert",
                str(src),
                str(out),
                *OPTS,
                "--shard-index",
                str(k),
                "--shard-count",
                "4",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for k in range(4)
    ]
    for p in procs:
        _, err = p.communicate(timeout=600)  # 4 at once on a busy 2-core machine: only a hang takes this long
        assert p.returncode == 0, err.decode()
    assert main(["convert", str(src), str(out), *OPTS, "--finalize"]) == 0
    assert tree_hashes(out) == tree_hashes(reference)


def test_finalize_refuses_a_missing_part_naming_the_file(fixture_dir, tmp_path, capsys) -> None:
    src, out = fixture_dir("fp4-2mtp"), tmp_path / "out"
    ckpt = open_checkpoint(src)
    plan = plan_conversion(ckpt.require_config(), ckpt.tensors, Options(tp=2, max_shard_size=300 * 1024))
    skipped = [f.relpath for f in select_files(plan, None, 1, 3)]
    for k in (0, 2):
        code, err = run(capsys, "convert", src, out, *OPTS, "--shard-index", k, "--shard-count", 3)
        assert code == 0, err
    code, err = run(capsys, "convert", src, out, *OPTS, "--finalize")
    assert code == 1
    assert skipped[0] in err and "missing" in err
    assert f"and {len(skipped) - 1} more" in err
    assert not (out / "ckpt-tool.json").exists()

    # run the missing shard; then damage one finished file: finalize names it (checksum)
    code, err = run(capsys, "convert", src, out, *OPTS, "--shard-index", 1, "--shard-count", 3)
    assert code == 0, err
    victim = out / skipped[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    code, err = run(capsys, "convert", src, out, *OPTS, "--finalize")
    assert code == 1 and skipped[0] in err and "sha256" in err
    victim.unlink()
    code, err = run(capsys, "convert", src, out, *OPTS, "--finalize")
    assert code == 1 and skipped[0] in err and "missing" in err
    assert not (out / "ckpt-tool.json").exists()


def test_finalize_with_other_options_finds_nothing_recorded(fixture_dir, tmp_path, capsys) -> None:
    src, out = fixture_dir("fp4"), tmp_path / "out"
    for k in range(2):
        assert run(capsys, "convert", src, out, *OPTS, "--shard-index", k, "--shard-count", 2)[0] == 0
    code, err = run(capsys, "convert", src, out, "--tp", "2", "--max-shard-size", "400KB", "--finalize")
    assert code == 1 and "cannot finalize" in err


def test_a_plain_rerun_after_shards_reuses_their_files(fixture_dir, reference, tmp_path, capsys) -> None:
    src, out = fixture_dir("fp4-2mtp"), tmp_path / "out"
    for k in range(2):
        assert run(capsys, "convert", src, out, *OPTS, "--shard-index", k, "--shard-count", 2)[0] == 0
    capsys.readouterr()
    assert main(["convert", str(src), str(out), *OPTS, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["files_written"] == 0 and doc["files_skipped"] == len(part_files(reference))
    assert tree_hashes(out) == tree_hashes(reference)


def test_ranks_produce_exactly_the_chosen_ranks(fixture_dir, tmp_path, capsys) -> None:
    src, out, full = fixture_dir("fp4"), tmp_path / "out", tmp_path / "full"
    code, err = run(capsys, "convert", src, out, "--tp", "4", "--ranks", "0,2-3")
    assert code == 0, err
    ranks = {int(PART_RE.match(Path(p).name).group(1)) for p in part_files(out)}
    assert ranks == {0, 2, 3}
    manifest = json.loads((out / "ckpt-tool.json").read_text())
    assert manifest["complete"] is True and manifest["ranks"] == [0, 2, 3]
    assert {int(v["rank"]) for v in manifest["outputs"].values()} == {0, 2, 3}
    for comp in ("model", "mtp"):
        index = json.loads((out / comp / "index.json").read_text())
        assert index["tp"] == 4 and set(index["ranks"]) == {"0", "2", "3"}
        assert (out / comp / "config.json").is_file()
    # each chosen rank's files are exactly those of a full conversion
    convert(src, full, Options(tp=4))
    h, hf = tree_hashes(out), tree_hashes(full)
    parts = {k: v for k, v in h.items() if k.endswith(".safetensors")}
    assert parts == {
        k: v for k, v in hf.items() if k.endswith(".safetensors") and PART_RE.match(Path(k).name).group(1) in "023"
    }


def test_ranks_and_shards_combine(fixture_dir, tmp_path, capsys) -> None:
    src, out = fixture_dir("fp4"), tmp_path / "out"
    for k in range(2):
        assert (
            run(capsys, "convert", src, out, "--tp", "4", "--ranks", "1", "--shard-index", k, "--shard-count", 2)[0]
            == 0
        )
    assert {int(PART_RE.match(Path(p).name).group(1)) for p in part_files(out)} == {1}
    assert run(capsys, "convert", src, out, "--tp", "4", "--ranks", "1", "--finalize")[0] == 0
    assert json.loads((out / "ckpt-tool.json").read_text())["ranks"] == [1]


def test_bad_selections_are_usage_or_input_errors(fixture_dir, tmp_path, capsys) -> None:
    src, out = fixture_dir("fp4"), tmp_path / "out"
    code, err = run(capsys, "convert", src, out, "--tp", "2", "--ranks", "2")
    assert code == 2 and "--ranks 2" in err and "outside 0..1" in err  # a usage error
    code, err = run(capsys, "convert", src, out, "--ranks", "x")
    assert code == 2 and "--ranks" in err
    code, err = run(capsys, "convert", src, out, "--shard-index", "3", "--shard-count", "3")
    assert code == 2
    assert not out.exists() or not any(out.iterdir())


def test_dry_run_shows_only_the_shard(fixture_dir, capsys) -> None:
    src = fixture_dir("fp4")
    capsys.readouterr()
    assert (
        main(
            [
                "convert",
                str(src),
                "unused",
                "--tp",
                "2",
                "--dry-run",
                "--json",
                "--shard-index",
                "1",
                "--shard-count",
                "2",
            ]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    ckpt = open_checkpoint(src)
    plan = plan_conversion(ckpt.require_config(), ckpt.tensors, Options(tp=2))
    assert [f["file"] for f in doc["files"]] == [f.relpath for f in select_files(plan, None, 1, 2)]


def test_numeric_on_a_ranks_subset_fails_and_says_what_to_run_instead(fixture_dir, tmp_path, capsys) -> None:
    """A node's share (--ranks 1,2 of --tp 4) passes --level values; --level numeric was asked for and cannot run
    without every rank, so it fails (exit 1) naming the ranks held and missing and the commands that do run."""
    src = fixture_dir("fp4")
    out = tmp_path / "ranks"
    convert(src, out, Options(tp=4), ranks=(1, 2))

    report = verify(out, src, level="numeric", kernels="torch", device="cpu")
    assert not report.ok and [c.name for c in report.failures] == ["numeric"]
    msg = report.failures[0].message
    assert "rank(s) 1,2 of --tp 4" in msg and "rank(s) 0,3 missing" in msg, msg
    assert "--level values" in msg and "--shard-index" in msg and "--finalize" in msg, msg
    assert report.failures[0].details["missing"] == [0, 3]
    assert any(c.name.startswith("values:mtp/model-rank-1") and c.status == "passed" for c in report.checks)
    assert report.coverage is None and report.numeric == []  # nothing numeric ran, and nothing says it did

    code, stdout, _ = run_cli(capsys, "verify", out, "--source", src, "--kernels", "torch", "--device", "cpu", "--json")
    doc = json.loads(stdout)
    assert code == 1 and doc["ok"] is False and doc["error"] == msg
    assert "numeric" not in doc["passed"] and [f["status"] for f in doc["failures"]] == ["failed"]
    assert run_cli(capsys, "verify", out, "--source", src, "--level", "values")[0] == 0
