"""Headers read by forked helpers (``ckpt_tool.checkpoint.forked_read``, for inspect and open_checkpoint): the same
answers as the serial path on every input, and the fork helpers themselves.

The fixtures have 4 shards, below the 8 the forked path waits for; these tests lower that floor so the
path runs on them, and compare it with the serial path (``CKPT_TOOL_NO_FORK=1``) on good fixtures, every
broken variant and every case of the hostile corpus.
"""

from __future__ import annotations

import json
import os
import signal
import types
from pathlib import Path

import pytest
from cli_helpers import run_cli

import ckpt_tool.checkpoint.forked_read as forked_read
from ckpt_tool.checkpoint.forked_read import hashes_keyed_at_random, index_digest, placement_digest
from ckpt_tool.checkpoint.source import open_checkpoint
from ckpt_tool.checkpoint.summary import inspect_forked, inspect_local
from ckpt_tool.fixtures.broken import CASE_SPECS, CASES, INDEX, S1, S2, S4, make_broken
from ckpt_tool.fixtures.make import VARIANTS
from ckpt_tool.processes import Child, TaskQueue, can_fork, helpers, usable_cpus

pytestmark = pytest.mark.skipif(
    not can_fork() or usable_cpus() < 2 or not hashes_keyed_at_random(),  # e.g. tox's fixed PYTHONHASHSEED
    reason="the forked path needs Linux, a spare CPU and hash randomization",
)


@pytest.fixture
def forking(monkeypatch):
    """The forked path for checkpoints of any shard count."""
    monkeypatch.setattr(forked_read, "FORK_MIN_FILES", 1)


def both_paths(capsys, monkeypatch, src: Path, *args: str) -> tuple[tuple, tuple]:
    forked = run_cli(capsys, "inspect", src, *args)
    monkeypatch.setenv("CKPT_TOOL_NO_FORK", "1")
    serial = run_cli(capsys, "inspect", src, *args)
    monkeypatch.delenv("CKPT_TOOL_NO_FORK")
    return forked, serial


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_forked_inspect_prints_what_the_serial_path_prints(
    forking, capsys, monkeypatch, fixture_dir, variant: str
) -> None:
    for args in ((), ("--json",)):
        forked, serial = both_paths(capsys, monkeypatch, fixture_dir(variant), *args)
        assert forked == serial


@pytest.mark.parametrize("name", [n for n in CASES if CASE_SPECS[n].inspect_exit is not None])
def test_forked_inspect_of_a_hostile_case_prints_what_the_serial_path_prints(
    forking, capsys, monkeypatch, fixture_dir, tmp_path, name: str
) -> None:
    case_dir = make_broken(tmp_path / name, name, fixture_dir("fp4"))
    spec = json.loads((case_dir / "case.json").read_text())
    monkeypatch.chdir(case_dir)
    forked, serial = both_paths(capsys, monkeypatch, *spec["inspect"][1:], "--json")
    assert forked == serial


@pytest.mark.parametrize("variant", ["fp4", "fp8", "fp4-2mtp"])
def test_forked_path_is_taken_for_a_healthy_checkpoint_and_matches_the_serial_report(
    forking, fixture_dir, monkeypatch, variant: str
) -> None:
    src = str(fixture_dir(variant))
    forked = inspect_forked(src)
    assert forked is not None, "the forked path declined a healthy checkpoint"
    monkeypatch.setenv("CKPT_TOOL_NO_FORK", "1")
    assert forked == inspect_local(src)


def test_forked_path_leaves_a_config_the_headers_disagree_with_to_the_serial_path(
    forking, fixture_copy, capsys, monkeypatch
) -> None:
    """The helpers' tallies keep each shard's distinct shapes, not a record per tensor: enough to tell that
    something disagrees, and the serial path words which tensor."""
    src = fixture_copy("fp4")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "hidden_size": 640}))
    assert inspect_forked(str(src)) is None
    forked, serial = both_paths(capsys, monkeypatch, src, "--json")
    assert forked == serial and forked[0] == 1 and "hidden_size 640" in forked[2]


def _move(src: Path, name: str, to: str) -> None:
    doc = json.loads((src / INDEX).read_text())
    doc["weight_map"][name] = to
    (src / INDEX).write_text(json.dumps(doc))


def _edit_index(src: Path, edit) -> None:
    doc = json.loads((src / INDEX).read_text())
    edit(doc["weight_map"])
    (src / INDEX).write_text(json.dumps(doc))


INDEX_EDITS = {
    "a tensor mapped to another shard": lambda wm: wm.__setitem__("layers.0.attn_norm.weight", S2),
    "two tensors' shards swapped": lambda wm: wm.update({"norm.weight": S1, "layers.0.attn_norm.weight": S4}),
    "a name the shards lack": lambda wm: wm.__setitem__("layers.0.attn.ghost", S1),
    "a stored tensor left out": lambda wm: wm.pop("layers.0.attn_norm.weight"),
    "one name swapped for another": lambda wm: (
        wm.pop("layers.0.attn_norm.weight"),
        wm.__setitem__("layers.0.attn.ghost", S1),
    ),
}


@pytest.mark.parametrize("edit", list(INDEX_EDITS))
def test_forked_path_declines_an_index_that_disagrees_with_the_headers(
    forking, fixture_copy, capsys, monkeypatch, edit: str
) -> None:
    """The placement digest catches each way an index can disagree; the serial path then words the error."""
    src = fixture_copy("fp4")
    assert inspect_forked(str(src)) is not None
    _edit_index(src, INDEX_EDITS[edit])
    assert inspect_forked(str(src)) is None
    forked, serial = both_paths(capsys, monkeypatch, src)
    assert forked == serial and forked[0] == 1 and "index" in forked[2]


def test_placement_digest_tells_every_swap_and_move_from_the_truth() -> None:
    """Stored placement vs an index with two tensors' files traded, or one tensor moved: the digests must
    differ every time (a sum of tuple hashes let about one swap in four through, hash-seed dependent)."""
    import random

    rng = random.Random(0)
    files = [f"model-{k:05d}-of-00046.safetensors" for k in range(1, 47)]
    for trial in range(300):
        names = [
            f"layers.{rng.randrange(61)}.ffn.experts.{rng.randrange(384)}.w{rng.randrange(1, 4)}.weight.{trial}.{i}"
            for i in range(6)
        ]
        stored = {n: rng.choice(files) for n in names}
        truth = sum(placement_digest(f, [n for n in names if stored[n] == f]) for f in set(stored.values()))
        assert index_digest(stored) == truth == index_digest(stored, sorted(set(stored.values())))
        a, b = names[0], names[1]
        if stored[a] != stored[b]:
            assert index_digest({**stored, a: stored[b], b: stored[a]}) != truth
        moved = rng.choice([f for f in files if f != stored[a]])
        assert index_digest({**stored, a: moved}) != truth


def test_forked_path_declines_a_tensor_stored_in_two_shards(forking, fixture_copy) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    src = fixture_copy("fp4")
    with safe_open(src / S1, "pt") as f:
        extra = {"layers.0.attn_norm.weight": f.get_tensor("layers.0.attn_norm.weight")}
    with safe_open(src / S4, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file({**tensors, **extra}, src / S4)  # the index still maps it to S1 only
    assert inspect_forked(str(src)) is None


@pytest.mark.parametrize("seed", ["0", "123"])
def test_forked_path_is_not_used_with_a_fixed_hash_seed(forking, fixture_dir, monkeypatch, seed: str) -> None:
    """The placement digest relies on str hashes keyed by a secret no input can be built against."""
    flags = types.SimpleNamespace(hash_randomization=int(seed != "0"), ignore_environment=0)
    monkeypatch.setattr(forked_read, "sys", types.SimpleNamespace(flags=flags))
    monkeypatch.setenv("PYTHONHASHSEED", seed)
    assert inspect_forked(str(fixture_dir("fp4"))) is None


def test_forked_path_waits_for_enough_shards(fixture_dir) -> None:
    assert inspect_forked(str(fixture_dir("fp4"))) is None  # 4 shards, below the floor of 8


# --- open_checkpoint (convert, verify, --dry-run) -------------------------------------------------


def same_checkpoint(a, b) -> None:
    assert (a.root, a.config, a.config_error, a.index_file) == (b.root, b.config, b.config_error, b.index_file)
    assert list(a.tensors.items()) == list(b.tensors.items())  # the same records, in the same order
    assert list(a.shards) == list(b.shards)
    for file in a.shards:
        x, y = a.shards[file], b.shards[file]
        assert (x.header_len, x.file_size, x.metadata, x.names, x.dtypes, x.header_sha256, x.dtype_totals) == (
            y.header_len,
            y.file_size,
            y.metadata,
            y.names,
            y.dtypes,
            y.header_sha256,
            y.dtype_totals,
        )


@pytest.mark.parametrize("variant", ["fp4", "fp8", "fp4-2mtp", "fp8-e8m0-pad"])
def test_forked_open_checkpoint_gives_the_serial_checkpoint(forking, fixture_dir, monkeypatch, variant: str) -> None:
    import ckpt_tool.checkpoint.source as source

    src = fixture_dir(variant)
    serial = open_checkpoint(src, forked=False)
    monkeypatch.setattr(
        source, "_open_checkpoint", lambda *a: pytest.fail("the forked path declined a healthy checkpoint")
    )
    same_checkpoint(open_checkpoint(src), serial)


@pytest.mark.parametrize("name", list(CASES))
def test_forked_open_checkpoint_of_a_hostile_case_answers_as_the_serial_one(
    forking, fixture_dir, tmp_path, name: str
) -> None:
    from ckpt_tool.errors import CkptToolError

    src = make_broken(tmp_path / name, name, fixture_dir("fp4")) / "src"
    outcomes = []
    for forked in (True, False):
        try:
            outcomes.append(open_checkpoint(src, forked=forked))
        except CkptToolError as exc:
            outcomes.append((type(exc), str(exc)))
    if isinstance(outcomes[1], tuple):
        assert outcomes[0] == outcomes[1]
    else:
        same_checkpoint(*outcomes)


def test_convert_with_forked_headers_writes_the_same_bytes(forking, fixture_dir, tmp_path, capsys, monkeypatch) -> None:
    from cli_helpers import snapshot

    import ckpt_tool.checkpoint.source as source

    answered = []
    real = source.read_shards_forked
    monkeypatch.setattr(source, "read_shards_forked", lambda *a, **k: answered.append(real(*a, **k)) or answered[-1])
    src = fixture_dir("fp4-2mtp")
    assert run_cli(capsys, "convert", src, tmp_path / "forked", "--tp", "2")[0] == 0
    assert answered and answered[0] is not None, "convert did not read its headers with helpers"
    monkeypatch.setenv("CKPT_TOOL_NO_FORK", "1")
    assert run_cli(capsys, "convert", src, tmp_path / "serial", "--tp", "2")[0] == 0
    written = [snapshot(tmp_path / out) for out in ("forked", "serial")]
    tensors = [{p: h for p, h in w.items() if p.endswith((".safetensors", ".index.json"))} for w in written]
    assert tensors[0] and tensors[0] == tensors[1]


# --- the fork helpers -------------------------------------------------------------------------------


def test_child_hands_back_its_value() -> None:
    with Child(lambda a, b: {"sum": a + b, "pid": os.getpid(), "items": [(1, True, "x")]}, 2, 3) as child:
        got = child.result()
    assert got["sum"] == 5 and got["pid"] != os.getpid() and got["items"] == [(1, True, "x")]


def test_child_that_raises_gives_none() -> None:
    def boom() -> None:
        raise RuntimeError("no")

    with Child(boom) as child:
        assert child.result() is None


def test_child_that_is_killed_gives_none() -> None:
    with Child(lambda: os.kill(os.getpid(), signal.SIGKILL)) as child:
        assert child.result() is None


def test_child_with_an_unmarshallable_value_gives_none() -> None:
    with Child(lambda: object()) as child:
        assert child.result() is None


def test_cancel_reaps_a_running_child() -> None:
    import time

    child = Child(time.sleep, 60)
    pid = child._pid
    child.cancel()
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # already reaped: no zombie left behind
    assert child.result() is None


def test_task_queue_hands_every_task_to_exactly_one_process() -> None:
    with TaskQueue(500) as queue:
        children = [Child(lambda: list(queue.take())) for _ in range(3)]
        mine = list(queue.take())
        theirs = [child.result() for child in children]
    taken = sorted(mine + [t for got in theirs for t in got])
    assert taken == list(range(500))


def test_task_queue_refuses_more_tasks_than_a_pipe_holds() -> None:
    with pytest.raises(ValueError, match="at most"):
        TaskQueue(TaskQueue.LIMIT + 1)


def test_a_refused_fork_leaves_the_work_to_this_process(forking, fixture_dir, monkeypatch) -> None:
    def no_fork() -> int:
        raise BlockingIOError(11, "Resource temporarily unavailable")

    src = str(fixture_dir("fp4"))
    monkeypatch.setattr(os, "fork", no_fork)
    alone = inspect_forked(src)
    monkeypatch.setenv("CKPT_TOOL_NO_FORK", "1")
    assert alone is not None and alone == inspect_local(src)


def test_helpers_start_as_many_as_the_system_allows(monkeypatch) -> None:
    real_fork, forks = os.fork, []

    def fork_twice() -> int:
        if len(forks) == 2:
            raise BlockingIOError(11, "Resource temporarily unavailable")
        forks.append(1)
        return real_fork()

    monkeypatch.setattr(os, "fork", fork_twice)
    with helpers(4, lambda: 7) as children:
        assert [c.result() for c in children] == [7, 7]
