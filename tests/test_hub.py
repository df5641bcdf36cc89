"""Hub sources (``org/name[@rev]``, ``hf://org/name[@rev]``) without any network.

A real huggingface_hub cache layout is built from a fixture
(``$HF_HOME/hub/models--org--name/{blobs/<sha>, refs/main, snapshots/<commit>/<file> -> ../../blobs/<sha>}``)
and the CLI runs in subprocesses with ``HF_HUB_OFFLINE=1`` and ``HF_HOME`` pointing there
(huggingface_hub reads both at import). The online path (plan from the hub's headers, then
``snapshot_download(allow_patterns=...)`` of only the needed shards) is tested in-process with
huggingface_hub's functions replaced by fakes that serve the same cache.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.hub import SERVING_PATTERNS, allow_patterns, needed_files, parse_hub_ref
from ckpt_tool.checkpoint.source import INDEX_NAME
from ckpt_tool.mapping.plan import HubNeeds, Options
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


def env_for(hf_home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_") and k != "CKPT_TOOL_DEBUG"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", **extra)
    return env


def cli(cwd: Path, hf_home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ckpt_tool", *map(str, args)],
        cwd=cwd,
        env=env_for(hf_home),
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
# Online path, with huggingface_hub's network functions replaced by fakes


class _FakeHub:
    """Serves fixture ``src`` as REPO_ID: model_info, get_safetensors_metadata, snapshot_download."""

    def __init__(self, src: Path, hf_home: Path) -> None:
        self.src, self.hf_home = src, hf_home
        self.downloads: list[list[str]] = []

    def model_info(self, repo_id, revision=None, **kw):
        assert repo_id == REPO_ID
        return type("Info", (), {"sha": COMMIT})()

    def get_safetensors_metadata(self, repo_id, revision=None, **kw):
        from huggingface_hub.utils import SafetensorsFileMetadata, TensorInfo

        from ckpt_tool.checkpoint.headers import read_shard_header

        files = {}
        for f in sorted(set(shard_of(self.src).values())):
            h = read_shard_header(self.src / f, f)
            files[f] = SafetensorsFileMetadata(
                metadata=h.metadata,
                tensors={
                    n: TensorInfo(
                        dtype=t.dtype, shape=list(t.shape), data_offsets=(t.start - h.data_start, t.end - h.data_start)
                    )
                    for n, t in h.tensors.items()
                },
            )
        return type("Meta", (), {"files_metadata": files})()

    def snapshot_download(self, repo_id, revision=None, allow_patterns=None, **kw):
        assert revision == COMMIT and not kw.get("local_files_only")
        self.downloads.append(list(allow_patterns))
        # as huggingface_hub filters repo files: fnmatch against every pattern
        files = [
            p.name for p in sorted(self.src.iterdir()) if any(fnmatch.fnmatch(p.name, pat) for pat in allow_patterns)
        ]
        return str(make_hf_cache(self.hf_home, self.src, files=files))


@pytest.fixture
def fake_hub(monkeypatch, tmp_path, fixture_dir):
    import huggingface_hub
    from huggingface_hub import constants

    fake = _FakeHub(fixture_dir("fp4"), tmp_path / "hf")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake.snapshot_download)
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda *a, **k: fake)
    return fake


def test_online_downloads_only_the_shards_the_plan_needs(fake_hub, tmp_path, capsys) -> None:
    from ckpt_tool.cli.entry import main

    src = fake_hub.src
    code = main(["convert", REPO_ID, str(tmp_path / "out"), "--only", "mtp", "--tp", "2"])
    assert code == 0, capsys.readouterr().err
    assert fake_hub.downloads[0] == ["config.json", INDEX_NAME, *SERVING_PATTERNS]  # config + index + tokenizer first
    assert fake_hub.downloads[-1] == ["config.json", INDEX_NAME, *SERVING_PATTERNS, *expected_mtp_files(src)]
    local = tmp_path / "local"
    convert(src, local, Options(tp=2, only="mtp"))
    assert tensor_files(tmp_path / "out") == tensor_files(local)


def test_online_plan_errors_come_before_any_shard_download(fake_hub, tmp_path, capsys) -> None:
    from ckpt_tool.cli.entry import main

    code = main(["convert", REPO_ID, str(tmp_path / "out"), "--tp", "3"])
    assert code == 1 and "tp=3" in capsys.readouterr().err
    assert all(not any(p.endswith(".safetensors") for p in d) for d in fake_hub.downloads)
    assert not (tmp_path / "out").exists()


def test_online_dry_run_downloads_no_shard(fake_hub, capsys) -> None:
    from ckpt_tool.cli.entry import main

    code = main(["convert", REPO_ID, "unused", "--tp", "2", "--dry-run", "--json"])
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["files"]
    assert all(not any(p.endswith(".safetensors") for p in d) for d in fake_hub.downloads)
    shutil.rmtree("unused", ignore_errors=True)


def test_online_convert_fetches_the_serving_files_into_out_model(fake_hub, tmp_path, capsys) -> None:
    from ckpt_tool.cli.entry import main
    from ckpt_tool.fixtures.make import serving_files

    code = main(["convert", REPO_ID, str(tmp_path / "out")])
    assert code == 0, capsys.readouterr().err
    for name in serving_files():
        assert (tmp_path / "out" / "model" / name).read_bytes() == (fake_hub.src / name).read_bytes()


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
    monkeypatch, fixture_dir, tmp_path, capsys
) -> None:
    import huggingface_hub
    from huggingface_hub import constants

    from ckpt_tool.cli.entry import main

    fake = _FakeHub(_edited_copy(fixture_dir, tmp_path), tmp_path / "hf")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake.snapshot_download)
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda *a, **k: fake)
    code = main(["convert", REPO_ID, str(tmp_path / "out")])
    assert code == 1 and MISMATCH in capsys.readouterr().err
    assert all(not any(p.endswith(".safetensors") for p in d) for d in fake.downloads)
    assert not (tmp_path / "out").exists()
