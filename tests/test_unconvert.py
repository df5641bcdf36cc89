"""``unconvert``: original → convert → unconvert gives back every source tensor byte for byte.

The comparison reads both checkpoints with ``safetensors.safe_open`` (names, dtypes, shapes, raw
bytes), independently of ckpt_tool's own header parsing; whole files are compared as well.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ckpt_tool.cli.entry import main
from ckpt_tool.errors import CheckpointError, OutputError
from ckpt_tool.fixtures.make import GOOD_VARIANTS, PAD_VARIANTS
from ckpt_tool.mapping.plan import Options
from ckpt_tool.output.convert import convert
from ckpt_tool.output.layout import MANIFEST, SOURCE_LAYOUT
from ckpt_tool.output.unconvert import unconvert

KB = 1024


def read_all(root: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...], bytes]]:
    """{name: (dtype, shape, raw bytes)} of every tensor in every .safetensors file under ``root``."""
    tensors = {}
    for f in sorted(root.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                t = fh.get_tensor(k)
                assert k not in tensors, f"{k} stored twice"
                tensors[k] = (t.dtype, tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
    return tensors


def file_hashes(root: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.iterdir()) if p.is_file()}


def assert_same_tensors(src: Path, back: Path, only: set[str] | None = None) -> None:
    a, b = read_all(src), read_all(back)
    if only is not None:
        a = {k: v for k, v in a.items() if k in only}
    assert set(b) == set(a), (sorted(set(a) - set(b))[:5], sorted(set(b) - set(a))[:5])
    for name, (dtype, shape, raw) in a.items():
        got = b[name]
        assert got[0] == dtype and got[1] == shape, (name, got[:2], (dtype, shape))
        assert got[2] == raw, f"{name}: bytes differ"


@pytest.mark.parametrize("moe", ["tp", "ep"])
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("variant", GOOD_VARIANTS)
def test_round_trip_is_byte_identical(fixture_dir, tmp_path, variant: str, tp: int, moe: str) -> None:
    src = fixture_dir(variant)
    out, back = tmp_path / "out", tmp_path / "back"
    convert(src, out, Options(tp=tp, moe_parallel=moe, max_shard_size=512 * KB))
    result = unconvert(out, back)
    assert result.missing == []
    assert_same_tensors(src, back)
    # every source file came back with its own header: the whole checkpoint is identical
    assert sorted(result.identical_files) == sorted(p.name for p in src.glob("*.safetensors"))
    assert file_hashes(back) == file_hashes(src)


PADDED = [
    ("fp4-pad", 2, "ep"),
    ("fp4-pad", 4, "ep"),
    ("fp8-e8m0-pad", 2, "ep"),
]  # MXFP4 experts at 192/96 rows a rank: ep only


@pytest.mark.parametrize("variant,tp,moe", PADDED, ids=[f"{v}-tp{t}-{m}" for v, t, m in PADDED])
def test_round_trip_drops_the_engine_zero_padding(fixture_dir, tmp_path, variant: str, tp: int, moe: str) -> None:
    assert variant in PAD_VARIANTS
    src = fixture_dir(variant)
    out, back = tmp_path / "out", tmp_path / "back"
    result = convert(src, out, Options(tp=tp, moe_parallel=moe, max_shard_size=512 * KB))
    assert any(t.padding for f in result.plan.files for t in f.tensors)  # the shared experts were padded
    result = unconvert(out, back)
    assert result.missing == []
    assert_same_tensors(src, back)
    assert file_hashes(back) == file_hashes(src)


@pytest.mark.parametrize("profile", ["vllm-seed", "vllm-0.33+"])
def test_round_trip_of_each_profile_with_converted_dtypes(fixture_dir, tmp_path, profile: str) -> None:
    # fp8-e8m0 under vllm-0.33: every E8M0 scale becomes float32 and tid2eid int32; both come back exactly
    src = fixture_dir("fp8-e8m0")
    out, back = tmp_path / "out", tmp_path / "back"
    convert(src, out, Options(tp=2, profile=profile))
    unconvert(out, back)
    assert file_hashes(back) == file_hashes(src)


def test_cli_unconvert_json_and_refuses_a_non_empty_dest(fixture_dir, tmp_path, capsys) -> None:
    src = fixture_dir("fp4")
    out, back = tmp_path / "out", tmp_path / "back"
    assert main(["convert", str(src), str(out), "--tp", "2", "--json"]) == 0
    capsys.readouterr()
    assert main(["unconvert", str(out), str(back), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is True and doc["missing"] == [] and len(doc["identical_files"]) == 4
    assert file_hashes(back) == file_hashes(src)
    code = main(["unconvert", str(out), str(back)])
    assert code == 1 and "not empty" in capsys.readouterr().err
    assert main(["unconvert", str(out), str(back), "--force"]) == 0
    assert file_hashes(back) == file_hashes(src)


def test_only_mtp_needs_partial_and_brings_back_what_it_holds(fixture_dir, tmp_path, capsys) -> None:
    src = fixture_dir("fp4")  # no stored MTP embedding/head: they were materialized from embed/head
    out, back = tmp_path / "out", tmp_path / "back"
    convert(src, out, Options(tp=2, only="mtp"))
    with pytest.raises(CheckpointError, match=r"--only mtp.*--partial"):
        unconvert(out, back)
    assert not back.exists()
    result = unconvert(out, back, partial=True)
    names = {n for n in read_all(src) if n.startswith("mtp.")} | {"embed.weight", "head.weight"}
    assert_same_tensors(src, back, only=names)
    assert all(n.startswith("layers.") or n in ("norm.weight",) or n.startswith("hc_head") for n in result.missing)
    index = json.loads((back / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == names
    assert all((back / f).is_file() for f in set(index["weight_map"].values()))


def test_ranks_subset_needs_partial_and_never_invents_bytes(fixture_dir, tmp_path) -> None:
    src = fixture_dir("fp4")
    out, back = tmp_path / "out", tmp_path / "back"
    convert(src, out, Options(tp=2), ranks=[1])
    with pytest.raises(CheckpointError, match=r"only ranks \[1\]"):
        unconvert(out, back)
    result = unconvert(out, back, partial=True)
    # what comes back is exactly the replicated tensors (whole on rank 1); split ones are missing
    back_tensors = read_all(back)
    assert "layers.0.attn_norm.weight" in back_tensors and "layers.0.attn.wq_b.weight" in result.missing
    assert_same_tensors(src, back, only=set(back_tensors))


def test_old_out_without_source_layout_needs_source(fixture_dir, tmp_path) -> None:
    src = fixture_dir("fp8")
    out, back = tmp_path / "out", tmp_path / "back"
    convert(src, out, Options(tp=2))
    (out / SOURCE_LAYOUT).unlink()
    with pytest.raises(CheckpointError, match="--source"):
        unconvert(out, back)
    unconvert(out, back, source=src)
    assert file_hashes(back) == file_hashes(src)


def test_a_tampered_source_layout_is_refused(fixture_dir, tmp_path) -> None:
    src = fixture_dir("fp4")
    out = tmp_path / "out"
    convert(src, out, Options())
    layout = out / SOURCE_LAYOUT
    text = layout.read_text()
    assert "BF16" in text
    layout.write_text(text.replace("BF16", "F16", 1))
    with pytest.raises(CheckpointError, match="sha256"):
        unconvert(out, tmp_path / "back")


def _rewrite(out: Path, relpath: str, name: str, edit) -> None:
    """Edit one tensor of an output file and refresh the manifest's checksum for it."""
    path = out / relpath
    with safe_open(str(path), framework="pt") as fh:
        meta = fh.metadata()
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    tensors[name] = edit(tensors[name].clone())
    save_file(tensors, str(path), metadata=meta)
    m = json.loads((out / MANIFEST).read_text())
    m["outputs"][relpath]["size"] = path.stat().st_size
    m["outputs"][relpath]["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (out / MANIFEST).write_text(json.dumps(m, indent=2))


def _locate(out: Path, comp: str, rank: int, name: str) -> str:
    index = json.loads((out / comp / "index.json").read_text())
    return f"{comp}/{index['ranks'][str(rank)][name]}"


def test_replicas_that_disagree_are_refused(fixture_dir, tmp_path) -> None:
    src = fixture_dir("fp4")
    out = tmp_path / "out"
    convert(src, out, Options(tp=2))
    name = "model.layers.3.mtp_block.attn_norm.weight"
    rel = _locate(out, "mtp", 1, name)

    def bump(t):
        t[0] = t[0] + 1
        return t

    _rewrite(out, rel, name, bump)
    with pytest.raises(CheckpointError, match=r"mtp\.0\.attn_norm\.weight: copies disagree"):
        unconvert(out, tmp_path / "back")


def test_a_float32_scale_that_is_not_a_power_of_two_is_refused(fixture_dir, tmp_path) -> None:
    src = fixture_dir("fp8-e8m0")  # fp8 experts with E8M0 scales: written as float32 2^(b-127)
    out = tmp_path / "out"
    convert(src, out, Options(profile="vllm-seed"))
    name = "model.layers.3.mtp_block.ffn.experts.w2_weight_scale_inv"
    rel = _locate(out, "mtp", 0, name)

    def skew(t):
        t.view(-1)[5] = 0.3
        return t

    _rewrite(out, rel, name, skew)
    with pytest.raises(CheckpointError, match="not 2\\^\\(b-127\\)"):
        unconvert(out, tmp_path / "back")


def test_unfinished_out_and_dest_inside_out_are_refused(fixture_dir, tmp_path) -> None:
    src = fixture_dir("fp4")
    out = tmp_path / "out"
    convert(src, out, Options())
    with pytest.raises(OutputError, match="outside OUT"):
        unconvert(out, out / "back")
    m = json.loads((out / MANIFEST).read_text())
    m["complete"] = False
    (out / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="not complete"):
        unconvert(out, tmp_path / "back")
    shutil.rmtree(out)
    with pytest.raises(CheckpointError, match="not a finished"):
        unconvert(out, tmp_path / "back")
