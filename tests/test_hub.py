"""Hub sources (``org/name[@rev]``, ``hf://org/name[@rev]``), with the real huggingface_hub client.

Offline: a real huggingface_hub cache layout is built from a fixture
(``$HF_HOME/hub/models--org--name/{blobs/<sha>, refs/main, snapshots/<commit>/<file> -> ../../blobs/<sha>}``)
and the CLI runs with ``HF_HUB_OFFLINE=1``. Online: a fixture is served by ``tests/hub_server.py``, a local
imitation of the hub's HTTP endpoints, and the CLI runs with ``HF_ENDPOINT`` pointing there; what was fetched is
asserted from the server's request log. Either way the CLI runs in a subprocess with ``HF_HOME`` in ``tmp_path``
(huggingface_hub reads these variables at import), and nothing of huggingface_hub is replaced.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hub_server import HubServer, Request

from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.hub import allow_patterns, needed_files, parse_hub_ref
from ckpt_tool.checkpoint.source import INDEX_NAME
from ckpt_tool.mapping.hub_needs import HubNeeds
from ckpt_tool.mapping.plan import Options
from ckpt_tool.output.convert import convert

REPO = Path(__file__).resolve().parents[1]
REPO_ID = "deepseek-ai/Tiny-V4"
COMMIT = hashlib.sha1(b"tiny-v4").hexdigest()


def make_hf_cache(hf_home: Path, src: Path, repo_id: str = REPO_ID, files: list[str] | None = None) -> Path:
    """An HF cache holding ``src`` as repo ``repo_id`` at revision main (only ``files`` of it, if given)."""
    repo_dir = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / "main").write_text(COMMIT)
    snap = repo_dir / "snapshots" / COMMIT
    snap.mkdir(parents=True, exist_ok=True)
    wanted = files if files is not None else sorted(p.name for p in src.iterdir() if p.is_file())
    for name in wanted:
        data = (src / name).read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        (repo_dir / "blobs" / sha).write_bytes(data)
        link = snap / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(Path("..") / ".." / "blobs" / sha)
    return snap


def shard_of(src: Path) -> dict[str, str]:
    return json.loads((src / INDEX_NAME).read_text())["weight_map"]


def expected_mtp_files(src: Path) -> list[str]:
    """Written from the fixture's layout, not from ckpt_tool: shards with mtp.*, plus embed/head when
    the checkpoint stores no MTP embedding/head (they are then copied from embed/head)."""
    wm = shard_of(src)
    files = {f for n, f in wm.items() if n.startswith("mtp.")}
    if "mtp.0.emb.tok_emb.weight" not in wm:
        files.add(wm["embed.weight"])
    if "mtp.0.head.weight" not in wm:
        files.add(wm["head.weight"])
    return sorted(files)


def env_for(hf_home: Path, endpoint: str | None = None) -> dict[str, str]:
    """Offline (HF_HUB_OFFLINE=1), or online against ``endpoint`` (HF_ENDPOINT): never the real hub."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and k != "CKPT_TOOL_DEBUG"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    env.update(HF_HOME=str(hf_home), HF_HUB_DISABLE_TELEMETRY="1")
    env.update({"HF_ENDPOINT": endpoint} if endpoint else {"HF_HUB_OFFLINE": "1"})
    return env


def cli(cwd: Path, hf_home: Path, *args: str, endpoint: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ckpt_tool", *map(str, args)],
        cwd=cwd,
        env=env_for(hf_home, endpoint),
        capture_output=True,
        text=True,
        timeout=300,
    )


def tensor_files(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and (p.suffix == ".safetensors" or p.name in ("index.json", "config.json"))
    }


# ---------------------------------------------------------------------------------------------
# Which files a plan needs (allow_patterns)


def test_parse_hub_ref(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert parse_hub_ref("org/name") == parse_hub_ref("hf://org/name")
    r = parse_hub_ref("hf://org/name@v1.0")
    assert (r.repo_id, r.revision) == ("org/name", "v1.0")
    assert parse_hub_ref(f"org/name@{COMMIT}").revision == COMMIT
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert parse_hub_ref("org/name") is None  # an existing local path wins
    assert parse_hub_ref("hf://org/name") is not None


@pytest.mark.parametrize("variant", ["fp4", "fp4-mtp-emb", "fp4-2mtp", "fp8"])
def test_allow_patterns_for_only_mtp_model_and_both(fixture_dir, variant: str) -> None:
    src = fixture_dir(variant)
    wm = shard_of(src)
    cfg = V4Config.load(src / "config.json")
    every = sorted(set(wm.values()))
    mtp = needed_files(wm, cfg, HubNeeds(Options(only="mtp")))
    assert mtp == expected_mtp_files(src)
    assert len(mtp) < len(every)  # the point: part of the repo
    # --only model still reads the MTP headers (every MTP layer must be present), so: everything
    assert needed_files(wm, cfg, HubNeeds(Options(only="model"))) == every
    assert needed_files(wm, cfg, HubNeeds(Options())) == every
    assert allow_patterns(wm, cfg, HubNeeds(Options(only="mtp"))) == ["config.json", INDEX_NAME, *mtp]


def test_fp4_only_mtp_skips_the_shard_without_mtp_embed_or_head(fixture_dir) -> None:
    src = fixture_dir("fp4")
    wm = shard_of(src)
    cfg = V4Config.load(src / "config.json")
    mtp = needed_files(wm, cfg, HubNeeds(Options(only="mtp", tp=2)))
    assert wm["embed.weight"] in mtp and wm["head.weight"] in mtp  # materialized from them
    assert wm["layers.1.attn_norm.weight"] not in mtp


# ---------------------------------------------------------------------------------------------
# Offline, from a populated cache


@pytest.fixture(scope="module")
def full_cache(fixture_dir, tmp_path_factory):
    hf_home = tmp_path_factory.mktemp("hf-full")
    make_hf_cache(hf_home, fixture_dir("fp4"))
    return hf_home


def test_offline_inspect_from_cache(full_cache, tmp_path) -> None:
    res = cli(tmp_path, full_cache, "inspect", REPO_ID, "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["source"] == REPO_ID


def test_offline_convert_and_verify_from_cache_equal_the_local_folder(full_cache, fixture_dir, tmp_path) -> None:
    out = tmp_path / "out"
    res = cli(tmp_path, full_cache, "convert", f"hf://{REPO_ID}@main", out, "--tp", "2")
    assert res.returncode == 0, res.stderr
    local = tmp_path / "local"
    convert(fixture_dir("fp4"), local, Options(tp=2))
    assert tensor_files(out) == tensor_files(local)
    res = cli(tmp_path, full_cache, "verify", out, "--source", REPO_ID, "--level", "values")
    assert res.returncode == 0, res.stderr + res.stdout


def test_offline_convert_by_commit_revision(full_cache, tmp_path) -> None:
    res = cli(tmp_path, full_cache, "convert", f"{REPO_ID}@{COMMIT}", tmp_path / "out", "--only", "mtp", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["ok"] is True


def test_offline_unknown_repo_names_it_and_hf_hub_offline(full_cache, tmp_path) -> None:
    res = cli(tmp_path, full_cache, "convert", "other-org/Nope", tmp_path / "out")
    assert res.returncode == 1
    assert "other-org/Nope" in res.stderr and "HF_HUB_OFFLINE" in res.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("variant", ["fp4", "fp4-mtp-emb"])
def test_partial_cache_converts_only_mtp_offline(fixture_dir, tmp_path, variant: str) -> None:
    src = fixture_dir(variant)
    hf_home = tmp_path / "hf"
    make_hf_cache(hf_home, src, files=["config.json", INDEX_NAME, *expected_mtp_files(src)])
    out = tmp_path / "out"
    res = cli(tmp_path, hf_home, "convert", REPO_ID, out, "--only", "mtp", "--tp", "2")
    assert res.returncode == 0, res.stderr
    local = tmp_path / "local"
    convert(src, local, Options(tp=2, only="mtp"))
    assert tensor_files(out) == tensor_files(local)
    manifest = json.loads((out / "ckpt-tool.json").read_text())
    assert sorted(manifest["source"]["files"]) == expected_mtp_files(src)

    # the full conversion needs the shards that are not cached: named, nothing written
    res = cli(tmp_path, hf_home, "convert", REPO_ID, tmp_path / "out2")
    assert res.returncode == 1
    absent = sorted(set(shard_of(src).values()) - set(expected_mtp_files(src)))
    assert all(f in res.stderr for f in absent) and "HF_HUB_OFFLINE" in res.stderr
    assert not (tmp_path / "out2").exists()
    # inspect needs every header: names what is missing
    res = cli(tmp_path, hf_home, "inspect", REPO_ID)
    assert res.returncode == 1 and absent[0] in res.stderr


def test_verify_source_hub_for_only_mtp_outputs(full_cache, fixture_dir, tmp_path) -> None:
    # converted from the full local folder: verify against the (full) cached repo passes
    out = tmp_path / "out"
    convert(fixture_dir("fp4"), out, Options(tp=2, only="mtp"))
    res = cli(tmp_path, full_cache, "verify", out, "--source", REPO_ID, "--level", "values")
    assert res.returncode == 0, res.stderr + res.stdout
    # converted from part of the repo: verified against that same partial checkpoint, every level
    part = tmp_path / "part"
    assert cli(tmp_path, full_cache, "convert", REPO_ID, part, "--only", "mtp").returncode == 0
    res = cli(tmp_path, full_cache, "verify", part, "--source", REPO_ID, "--kernels", "torch", "--json")
    assert res.returncode == 0, res.stderr + res.stdout
    assert json.loads(res.stdout)["numeric"], "the numeric level ran on the partial source"


def test_cache_missing_a_needed_shard_fails_naming_it(fixture_dir, tmp_path) -> None:
    src = fixture_dir("fp4")
    needed = expected_mtp_files(src)
    hf_home = tmp_path / "hf"
    make_hf_cache(hf_home, src, files=["config.json", INDEX_NAME, *needed[1:]])
    res = cli(tmp_path, hf_home, "convert", REPO_ID, tmp_path / "out", "--only", "mtp")
    assert res.returncode == 1
    assert needed[0] in res.stderr
    assert all(f not in res.stderr for f in needed[1:])
    assert not (tmp_path / "out").exists()


def test_local_folder_with_a_missing_shard_is_still_an_error(fixture_copy, tmp_path, capsys) -> None:
    from ckpt_tool.cli.entry import main

    src = fixture_copy("fp4")
    victim = shard_of(src)["layers.1.attn_norm.weight"]
    (src / victim).unlink()
    code = main(["convert", str(src), str(tmp_path / "out"), "--only", "mtp"])
    assert code == 1 and victim in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Online: the real huggingface_hub client, in the CLI's subprocess, against tests/hub_server.py


@pytest.fixture
def hub(fixture_dir):
    """The fp4 fixture served as REPO_ID (branch main) by a local hub imitation."""
    with HubServer() as server:
        server.push(REPO_ID, fixture_dir("fp4"))
        yield server


def online(cwd: Path, hub: HubServer, *args: str) -> subprocess.CompletedProcess:
    """The CLI with HF_ENDPOINT at ``hub`` and an empty HF cache under ``cwd``."""
    return cli(cwd, cwd / "hf", *args, endpoint=hub.url)


def header_read(r: Request) -> bool:
    """get_safetensors_metadata's reads of a shard: its first 100,000 bytes, then the rest of a longer header."""
    return r.range is not None and (r.range == "bytes=0-100000" or r.range.startswith("bytes=8-"))


def shard_bytes(hub: HubServer) -> dict[str, int]:
    """Bytes of each .safetensors file sent beyond the header reads: what was downloaded."""
    sent: dict[str, int] = {}
    for r in hub.requests("GET"):
        if r.file and r.file.endswith(".safetensors") and not header_read(r) and r.sent:
            sent[r.file] = sent.get(r.file, 0) + r.sent
    return sent


def sizes(src: Path, files: list[str]) -> dict[str, int]:
    return {f: (src / f).stat().st_size for f in files}


def test_online_inspect_reads_headers_only(hub, fixture_dir, tmp_path) -> None:
    res = online(tmp_path, hub, "inspect", REPO_ID, "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["source"] == REPO_ID
    assert shard_bytes(hub) == {}
    shards = sorted(set(shard_of(fixture_dir("fp4")).values()))
    # each shard: one 100 kB read answered by the CDN with its header and the first tensor bytes
    assert sorted(r.file for r in hub.requests("GET", host="cdn") if header_read(r)) == shards


def test_online_downloads_only_the_shards_the_plan_needs(hub, fixture_dir, tmp_path) -> None:
    src = fixture_dir("fp4")
    res = online(tmp_path, hub, "convert", REPO_ID, tmp_path / "out", "--only", "mtp", "--tp", "2")
    assert res.returncode == 0, res.stderr
    needed = expected_mtp_files(src)
    assert len(needed) < len(set(shard_of(src).values()))
    assert shard_bytes(hub) == sizes(src, needed)  # each needed shard whole, once; no other shard
    # plan before bytes: every header read and the config came before the first shard byte
    log = hub.requests()
    first = next(i for i, r in enumerate(log) if r.file in needed and not header_read(r) and r.method == "GET")
    assert all(i < first for i, r in enumerate(log) if header_read(r) or r.file in ("config.json", INDEX_NAME))
    # the revision was resolved once, and every read is pinned to its commit
    commit = hub.repos[REPO_ID].refs["main"]
    resolves = [r for r in log if r.host == "hub" and "/resolve/" in r.path]
    assert resolves and all(f"/resolve/{commit}/" in r.path for r in resolves)
    local = tmp_path / "local"
    convert(src, local, Options(tp=2, only="mtp"))
    assert tensor_files(tmp_path / "out") == tensor_files(local)


def test_online_convert_is_byte_identical_to_a_local_conversion(hub, fixture_dir, tmp_path) -> None:
    from ckpt_tool.fixtures.make import serving_files

    src = fixture_dir("fp4")
    out = tmp_path / "out"
    res = online(tmp_path, hub, "convert", f"hf://{REPO_ID}@main", out, "--tp", "2")
    assert res.returncode == 0, res.stderr
    assert shard_bytes(hub) == sizes(src, sorted(set(shard_of(src).values())))
    local = tmp_path / "local"
    convert(src, local, Options(tp=2))
    assert tensor_files(out) == tensor_files(local)
    # the serving files (tokenizer, generation config, chat template) fetched into OUT/model
    for name in serving_files():
        assert (out / "model" / name).read_bytes() == (src / name).read_bytes()


def test_online_plan_errors_come_before_any_shard_download(hub, tmp_path) -> None:
    res = online(tmp_path, hub, "convert", REPO_ID, tmp_path / "out", "--tp", "3")
    assert res.returncode == 1 and "tp=3" in res.stderr
    assert hub.requests(file="config.json")  # it did get as far as the plan
    assert shard_bytes(hub) == {}
    assert not (tmp_path / "out").exists()


def test_online_dry_run_downloads_no_shard(hub, tmp_path) -> None:
    res = online(tmp_path, hub, "convert", REPO_ID, tmp_path / "out", "--tp", "2", "--dry-run", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["files"]
    assert shard_bytes(hub) == {}
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("source", "named"),
    [("other-org/Nope", "other-org/Nope"), (f"{REPO_ID}@no-such-branch", f"{REPO_ID}@no-such-branch")],
    ids=["repo", "revision"],
)
@pytest.mark.parametrize("command", ["convert", "inspect"])
def test_online_unknown_repo_or_revision_is_one_line_naming_it(hub, tmp_path, command, source, named) -> None:
    args = ("convert", source, tmp_path / "out") if command == "convert" else ("inspect", source)
    res = online(tmp_path, hub, *args)
    assert res.returncode == 1, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0], res.stderr
    assert "check the repo id and revision" in lines[0]
    assert shard_bytes(hub) == {}
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["convert", "inspect"])
def test_online_unreachable_hub_is_one_line_naming_the_network_fix(tmp_path, command) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    args = ("convert", REPO_ID, tmp_path / "out") if command == "convert" else ("inspect", REPO_ID)
    res = cli(tmp_path, tmp_path / "hf", *args, endpoint=closed)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1 and REPO_ID in lines[0], res.stderr
    assert "check the network (and HF_ENDPOINT" in lines[0] and "HF_HUB_OFFLINE=1" in lines[0]
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# A hub repo whose config.json disagrees with its headers: the verdict a local folder gets


def _edited_copy(fixture_dir, tmp_path: Path) -> Path:
    src = tmp_path / "edited"
    shutil.copytree(fixture_dir("fp4"), src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "hidden_size": 320}))
    return src


MISMATCH = (
    "hidden_size 320 in config.json, but tensor 'embed.weight' in model-00001-of-00004.safetensors is BF16 [512, 256]"
)


def test_offline_inspect_and_convert_refuse_a_config_the_headers_disagree_with(fixture_dir, tmp_path) -> None:
    hf_home = tmp_path / "hf"
    make_hf_cache(hf_home, _edited_copy(fixture_dir, tmp_path))
    res = cli(tmp_path, hf_home, "inspect", REPO_ID)
    assert res.returncode == 1 and MISMATCH in res.stderr and len(res.stderr.strip().splitlines()) == 1
    res = cli(tmp_path, hf_home, "convert", REPO_ID, tmp_path / "out")
    assert res.returncode == 1 and MISMATCH in res.stderr
    assert not (tmp_path / "out").exists()


def test_online_convert_refuses_a_config_the_headers_disagree_with_before_any_download(
    hub, fixture_dir, tmp_path
) -> None:
    hub.push("deepseek-ai/Tiny-V4-edited", _edited_copy(fixture_dir, tmp_path))
    res = online(tmp_path, hub, "convert", "deepseek-ai/Tiny-V4-edited", tmp_path / "out")
    assert res.returncode == 1 and MISMATCH in res.stderr
    assert shard_bytes(hub) == {}
    assert not (tmp_path / "out").exists()


def test_online_convert_counts_a_v41_repos_compressed_vocabulary_from_its_tokenizer(hub, fixture_dir, tmp_path):
    """A V4.1 repo's engram_compressed_vocab_size is compared with its tokenizer.json, downloaded with the other small
    files, before any shard: vLLM would refuse to start on the difference (ckpt_tool/checkpoint/engram_vocab.py)."""
    src = tmp_path / "v41-edited"
    shutil.copytree(fixture_dir("v41"), src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["text_config"]["engram_compressed_vocab_size"] -= 1
    (src / "config.json").write_text(json.dumps(cfg))
    hub.push("deepseek-ai/Tiny-V41-edited", src)
    res = online(tmp_path, hub, "convert", "deepseek-ai/Tiny-V41-edited", tmp_path / "out")
    assert res.returncode == 1, res.stderr
    assert "text_config.engram_compressed_vocab_size is 511 in config.json, but the tokenizer beside it" in res.stderr
    assert [line for line in res.stderr.splitlines() if line.startswith("error: ")] == [
        res.stderr.strip().splitlines()[-1]
    ], res.stderr  # one error line, after huggingface_hub's download progress
    assert shard_bytes(hub) == {}
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# The test ground itself: tests/hub_server.py answers the real client as the hub does (in-process, the
# endpoint passed explicitly: HF_ENDPOINT is read at import), ranges and injected faults included


SHARD = "model-00002-of-00004.safetensors"


def test_hub_server_serves_byte_ranges_through_hffilesystem(hub, fixture_dir) -> None:
    from huggingface_hub import HfFileSystem

    data = (fixture_dir("fp4") / SHARD).read_bytes()
    fs = HfFileSystem(endpoint=hub.url, token=False, skip_instance_cache=True)
    with fs.open(f"{REPO_ID}/{SHARD}", "rb", cache_type="none") as f:
        f.seek(1000)
        assert f.read(4096) == data[1000:5096]
        f.seek(len(data) - 10)
        assert f.read(100) == data[-10:]
    ranged = hub.requests("GET", file=SHARD)
    # each read: the resolve URL redirects (302) to the CDN, which answers 206 with the range (cut at the end)
    tail = f"bytes={len(data) - 10}-{len(data) + 89}"
    assert [(r.host, r.status, r.range, r.sent) for r in ranged] == [
        ("hub", 302, "bytes=1000-5095", 0),
        ("cdn", 206, "bytes=1000-5095", 4096),
        ("hub", 302, tail, 0),
        ("cdn", 206, tail, 10),
    ]


def test_hub_server_bodies_longer_than_its_read_block_are_the_files_bytes(hub, tmp_path) -> None:
    """The imitation reads a body from disk in whole pages (O_DIRECT), 8 MiB at a time: a range starting mid-page,
    crossing blocks and ending mid-page, and the whole file, come back byte for byte, counted as sent."""
    from hub_server import BODY_BLOCK
    from huggingface_hub import HfFileSystem

    data = os.urandom(2 * BODY_BLOCK + 12_345)
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "blob.bin").write_bytes(data)
    hub.push("org/big", tmp_path / "big")
    fs = HfFileSystem(endpoint=hub.url, token=False, skip_instance_cache=True)
    start, n = 4097, BODY_BLOCK + 8191
    with fs.open("org/big/blob.bin", "rb", cache_type="none") as f:
        f.seek(start)
        assert f.read(n) == data[start : start + n]
        f.seek(0)
        assert f.read() == data
    cdn = hub.requests("GET", file="blob.bin", host="cdn")
    assert [(r.status, r.sent) for r in cdn] == [(206, n), (200, len(data))]


def test_hub_server_falls_back_to_buffered_reads_where_direct_io_is_refused_at_the_read(
    hub, fixture_dir, monkeypatch
) -> None:
    """A file system may accept O_DIRECT at the open and refuse it (EINVAL) at the first read: the body is then read
    through the page cache, the same bytes."""
    import errno
    import fcntl

    from huggingface_hub import HfFileSystem

    real, refused = os.preadv, []

    def preadv(fd, buffers, offset, *rest):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buffers, offset, *rest)

    monkeypatch.setattr(os, "preadv", preadv)
    data = (fixture_dir("fp4") / SHARD).read_bytes()
    fs = HfFileSystem(endpoint=hub.url, token=False, skip_instance_cache=True)
    with fs.open(f"{REPO_ID}/{SHARD}", "rb", cache_type="none") as f:
        f.seek(1000)
        assert f.read(4096) == data[1000:5096]
    assert refused  # the injection fired


def test_hub_server_moves_a_branch_and_keeps_old_commits(hub, fixture_dir, tmp_path) -> None:
    from huggingface_hub import HfApi, hf_hub_download

    api = HfApi(endpoint=hub.url, token=False)
    old = api.model_info(REPO_ID).sha
    new = hub.push(REPO_ID, _edited_copy(fixture_dir, tmp_path))
    assert new != old and api.model_info(REPO_ID, revision="main").sha == new
    kw = {"endpoint": hub.url, "token": False, "cache_dir": tmp_path / "cache"}
    at_old = Path(hf_hub_download(REPO_ID, "config.json", revision=old, **kw)).read_bytes()
    at_main = Path(hf_hub_download(REPO_ID, "config.json", revision="main", **kw)).read_bytes()
    assert at_old == (fixture_dir("fp4") / "config.json").read_bytes()
    assert json.loads(at_main)["hidden_size"] == 320


def test_hub_server_faults_meet_huggingface_hubs_retries(hub, fixture_dir, tmp_path) -> None:
    from hub_server import Fault
    from huggingface_hub import HfFileSystem, hf_hub_download

    src = fixture_dir("fp4")
    kw = {"endpoint": hub.url, "token": False, "cache_dir": tmp_path / "cache"}
    # 503 on the HEAD, then 429 with Retry-After on the body: retried (http_backoff), the file arrives whole
    hub.inject(Fault(method="HEAD", file=SHARD, status=503))
    hub.inject(Fault(file=SHARD, host="cdn", status=429, retry_after=0))
    assert Path(hf_hub_download(REPO_ID, SHARD, **kw)).read_bytes() == (src / SHARD).read_bytes()
    assert [r.status for r in hub.requests(file=SHARD)] == [503, 302, 429, 200]

    # a connection dropped mid-body: http_get starts again (it resumes from the last 10 MB chunk it wrote)
    other = "model-00003-of-00004.safetensors"
    hub.inject(Fault(file=other, host="cdn", drop_after=1000))
    assert Path(hf_hub_download(REPO_ID, other, **kw)).read_bytes() == (src / other).read_bytes()
    assert [r.sent for r in hub.requests("GET", file=other)] == [1000, (src / other).stat().st_size]

    # a short body: hf_hub_download checks the size against the HEAD's; a range read does not check it
    last = "model-00004-of-00004.safetensors"
    hub.inject(Fault(file=last, host="cdn", short_by=7))
    with pytest.raises(OSError, match="Consistency check failed"):
        hf_hub_download(REPO_ID, last, **kw)
    hub.inject(Fault(file=last, host="cdn", short_by=7))
    fs = HfFileSystem(endpoint=hub.url, token=False, skip_instance_cache=True)
    with fs.open(f"{REPO_ID}/{last}", "rb", cache_type="none") as f:
        assert len(f.read(100)) == 93  # a streaming reader must check the length itself


def test_hub_server_errors_are_huggingface_hubs_errors(hub) -> None:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RemoteEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

    api = HfApi(endpoint=hub.url, token=False)
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("other-org/Nope")
    with pytest.raises(RevisionNotFoundError):
        api.model_info(REPO_ID, revision="no-such-branch")
    with pytest.raises(RemoteEntryNotFoundError):
        api.hf_hub_download(REPO_ID, "no-such-file.json", cache_dir=None)
    assert [r.status for r in hub.requests()] == [401, 404, 404]
