"""NVIDIA's NVFP4 exports of DeepSeek V4: which experts are NVFP4 (vLLM's own rule), what convert writes for them at
tp 1, tp 2 and ep (both input-scale layouts), verify's 100 % numeric coverage of them, what inspect says, and every
broken NVFP4 fixture refused before a byte is written with its own diagnosis.

vLLM's own loaders judge the same OUTs in tests/engine/test_engine_nvfp4.py.
"""

from __future__ import annotations

import json

import pytest
from cli_helpers import rank_keys, run_cli, snapshot

from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.expert_format import MXFP4, NVFP4, layer_format
from ckpt_tool.errors import CheckpointError
from ckpt_tool.fixtures.make import EXPERTS, HIDDEN, MOE_INTER, NVFP4_BROKEN_VARIANTS, NVFP4_VARIANTS, make_config
from ckpt_tool.fixtures.make import VARIANTS as FIXTURES

ROUTED = "model.layers.0.ffn.experts.routed_experts"


def _config(variant: str, **quant) -> V4Config:
    raw = make_config(FIXTURES[variant])
    raw["quantization_config"] = {**raw["quantization_config"], **quant}
    return V4Config.from_dict(raw)


# ---------------------------------------------------------------------------------------------
# Which experts are NVFP4: vLLM 0.33.0 / 0.34.0 models/deepseek_v41/quant_config.py _is_nvfp4_expert_layer


@pytest.mark.parametrize(
    ("quant", "main", "draft"),
    [
        ({}, NVFP4, MXFP4),  # the export's ignore: "mtp.*"
        ({"ignore": None}, NVFP4, NVFP4),  # absent: every expert layer
        ({"ignore": []}, NVFP4, NVFP4),  # empty: every expert layer
        ({"ignore": ["layers.0.*"]}, MXFP4, NVFP4),  # matched as layers.0.ffn.experts, fnmatchcase
        ({"ignore": ["LAYERS.0.*", "mtp.0"]}, NVFP4, NVFP4),  # case-sensitive; "mtp.0" is not mtp.0.ffn.experts
        ({"moe_quant_algo": "nvfp4"}, NVFP4, MXFP4),  # vLLM upper-cases the algorithm
        ({"moe_quant_algo": ""}, MXFP4, MXFP4),  # empty: DeepSeek's own format
    ],
)
def test_layer_format_is_vllms_choice(quant, main, draft):
    cfg = _config("nvfp4", **quant)
    assert layer_format(cfg, "layers.0") is main
    assert layer_format(cfg, "mtp.0") is draft


def test_unknown_moe_quant_algo_and_bad_ignore_are_config_errors():
    with pytest.raises(CheckpointError, match='moe_quant_algo is "MXFP8" in config.json, but it is a format'):
        _config("nvfp4", moe_quant_algo="MXFP8")
    with pytest.raises(CheckpointError, match="moe_quant_algo is 4 in config.json, but it is an integer"):
        _config("nvfp4", moe_quant_algo=4)
    # vLLM drops a non-list ignore and a list's non-strings, and would build the draft's MXFP4 experts as NVFP4
    with pytest.raises(CheckpointError, match=r'ignore is "mtp\.\*" in config.json, but it is a string'):
        _config("nvfp4", ignore="mtp.*")
    with pytest.raises(CheckpointError, match="but it is a list of mixed values; vLLM reads a list of strings"):
        _config("nvfp4", ignore=["mtp.*", 5])
    # read only with moe_quant_algo NVFP4, as vLLM reads it
    assert _config("fp4", ignore="anything").moe_quant.ignore == ()


# ---------------------------------------------------------------------------------------------
# convert and verify


@pytest.mark.parametrize(
    ("tp", "ep", "scales"), [(1, False, "global"), (2, False, "global"), (2, True, "global"), (2, True, "local")]
)
def test_convert_writes_modelopts_nvfp4_parameters(tp, ep, scales, fixture_dir, tmp_path, capsys):
    out = tmp_path / "out"
    moe = ["--moe-parallel", "ep", "--nvfp4-input-scales", scales] if ep else []
    code, _, err = run_cli(capsys, "convert", fixture_dir("nvfp4"), out, "--tp", tp, *moe, "-q")
    assert code == 0, err
    E, I, H = EXPERTS, MOE_INTER, HIDDEN
    El, Il = (E // tp, I) if ep else (E, I // tp)
    Eg = El if ep and scales == "local" else E
    want = {
        "w13_weight": ("U8", (El, 2 * Il, H // 2)),
        "w13_weight_scale": ("F8_E4M3", (El, 2 * Il, H // 16)),
        "w13_weight_scale_2": ("F32", (El, 2)),
        "w13_input_scale": ("F32", (Eg, 2)),
        "w2_weight": ("U8", (El, H, Il // 2)),
        "w2_weight_scale": ("F8_E4M3", (El, H, Il // 16)),
        "w2_weight_scale_2": ("F32", (El,)),
        "w2_input_scale": ("F32", (Eg,)),
    }
    for rank in range(tp):
        got = {k.rsplit(".", 1)[1]: v for k, v in rank_keys(out, "model", rank).items() if k.startswith(ROUTED + ".")}
        assert got == want, rank
        draft = {k.rsplit(".", 1)[1]: v for k, v in rank_keys(out, "mtp", rank).items() if ".routed_experts." in k}
        assert sorted(draft) == ["w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"]  # left MXFP4
    manifest = json.loads((out / "ckpt-tool.json").read_text())
    assert manifest["options"].get("nvfp4_input_scales") == (scales if ep else None)
    # the manifest names the backends the layout is for
    backends = [n for n in manifest["notes"] if n.startswith("NVFP4 experts under ep")]
    assert len(backends) == ep and (
        not ep or ("FLASHINFER_TRTLLM" in backends[0].split(";")[0]) == (scales == "global")
    )


@pytest.mark.parametrize("variant", NVFP4_VARIANTS)
@pytest.mark.parametrize(("tp", "ep"), [(1, False), (2, True)])
def test_verify_numeric_covers_every_nvfp4_tensor(variant, tp, ep, fixture_dir, tmp_path, capsys):
    src, out = fixture_dir(variant), tmp_path / "out"
    code, _, err = run_cli(capsys, "convert", src, out, "--tp", tp, *(["--moe-parallel", "ep"] if ep else []), "-q")
    assert code == 0, err
    code, doc, err = run_cli(capsys, "verify", out, "--source", src, "--level", "numeric", "--json")
    assert code == 0, (err, doc)
    coverage = json.loads(doc)["coverage"]
    assert coverage["checked"] == coverage["total"] > 0 and coverage["percent"] == 100.0, coverage


def test_verify_catches_an_nvfp4_global_scale_written_for_the_other_part(fixture_dir, tmp_path, capsys):
    """w1's and w3's global scales swapped in one rank's w13_weight_scale_2: the numeric level names the tensor."""
    import torch
    from test_verify import rewrite_tensors  # in place, the manifest's checksums re-recorded: only numbers differ

    src, out = fixture_dir("nvfp4"), tmp_path / "out"
    assert run_cli(capsys, "convert", src, out, "--tp", 2, "-q")[0] == 0
    key = f"{ROUTED}.w13_weight_scale_2"
    rewrite_tensors(out, 1, {key: lambda t: torch.flip(t, dims=[1]).contiguous()}, comp="model")
    code, doc, _ = run_cli(capsys, "verify", out, "--source", src, "--level", "numeric", "--json")
    assert code == 1
    failed = [c for c in json.loads(doc)["results"] if c["status"] == "failed"]
    assert any(key in (c.get("message") or "") for c in failed), failed


def test_the_seed_profile_refuses_nvfp4_experts(fixture_dir, tmp_path, capsys):
    code, _, err = run_cli(capsys, "convert", fixture_dir("nvfp4"), tmp_path / "out", "--target", "vllm-seed")
    assert code == 1 and "nvfp4 routed experts" in err and "vllm-seed" in err, err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# inspect


def test_inspect_names_each_layers_expert_format(fixture_dir, capsys):
    code, doc, _ = run_cli(capsys, "inspect", fixture_dir("nvfp4"), "--json")
    assert code == 0
    experts = json.loads(doc)["model"]["experts"]
    assert experts["formats"]["nvfp4"]["blocks"] == ["layers.0", "layers.1", "layers.2"]
    assert experts["formats"]["nvfp4"]["vllm_method"] == "ModelOptNvFp4FusedMoE"
    assert experts["formats"]["mxfp4"]["blocks"] == ["mtp.0"] and experts["left_by_ignore"] == ["mtp.0"]
    code, text, _ = run_cli(capsys, "inspect", fixture_dir("nvfp4-all"))
    assert "NVFP4 (ModelOptNvFp4FusedMoE) in layers.0-2, mtp.0" in text and "ignore [none]" in text


def test_inspect_counts_nvfp4_weight_scales_as_the_experts_scales(fixture_dir, capsys):
    """NVFP4's block scales are ``.weight_scale`` (E4M3), not DeepSeek's ``.scale`` (E8M0): the quantization summary
    named the draft's E8M0 scales for an export whose main layers hold E4M3 ones."""
    code, doc, _ = run_cli(capsys, "inspect", fixture_dir("nvfp4-all"), "--json")
    assert code == 0
    quant = json.loads(doc)["quant"]
    assert (quant["expert_weight_dtype"], quant["expert_scale_dtype"]) == ("U8", "F8_E4M3")
    assert quant["linear_scale_dtype"] == "F8_E8M0"  # the linears keep DeepSeek's block FP8


# ---------------------------------------------------------------------------------------------
# broken exports: refused before writing, each with its own diagnosis

BROKEN = {
    "nvfp4-missing-scale-2": ("layers.1.ffn.experts.3.w2.weight_scale_2", "float32 global scale"),
    "nvfp4-missing-input-scale": ("layers.0.ffn.experts.5.w1.input_scale", "float32 activation scale"),
    "nvfp4-scale-grid": ("layers.2.ffn.experts.2.w3.weight_scale", "one scale per 32 inputs"),
    "nvfp4-ignore-mismatch": ("quantization_config.ignore pattern 'layers.1.*'", "format is ambiguous"),
    "nvfp4-unknown-algo": ('moe_quant_algo is "MXFP8"', "does not know"),
}


def test_every_broken_nvfp4_fixture_has_its_diagnosis():
    assert sorted(BROKEN) == sorted(NVFP4_BROKEN_VARIANTS)


@pytest.mark.parametrize("variant", sorted(BROKEN))
def test_broken_nvfp4_export_is_refused_before_writing(variant, fixture_dir, tmp_path, capsys):
    src, out = fixture_dir(variant), tmp_path / "out"
    before = snapshot(src)
    names, says = BROKEN[variant]
    code, _, err = run_cli(capsys, "convert", src, out, "--tp", 2)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1, err
    assert names in err and says in err, err
    assert "download the missing files again" not in err or "missing" in variant, err
    assert not out.exists()
    assert snapshot(src) == before
    code, _, err = run_cli(capsys, "inspect", src)
    assert code == 1 and names.split(" ")[0] in err, err


@pytest.mark.parametrize("variant", ["nvfp4", "nvfp4-all"])
@pytest.mark.parametrize(
    ("tp", "moe", "scales"), [(1, "tp", None), (2, "tp", None), (4, "ep", "global"), (4, "ep", "local")]
)
def test_numeric_units_name_every_nvfp4_engine_parameter(variant, tp, moe, scales, fixture_dir):
    """verify's numeric units of an NVFP4 OUT name every parameter the engine holds on every rank, no other (so the
    coverage counts every NVFP4 tensor), in both input-scale layouts."""
    from ckpt_tool.checkpoint.source import open_checkpoint
    from ckpt_tool.mapping.engine_table import engine_params
    from ckpt_tool.verify.tensor_units import tensor_units, unit_tensors

    ckpt = open_checkpoint(fixture_dir(variant))
    cfg = ckpt.require_config()
    for comp in ("model", "mtp"):
        units = tensor_units(cfg, "vllm-0.33+", comp, tp, moe, set(ckpt.tensors), None, scales == "global")
        expected = set(engine_params(cfg, "vllm-0.33+", comp, tp, moe, 0, None, scales))
        assert any(n.endswith("w13_input_scale") for n in expected) == (comp == "model" or variant == "nvfp4-all")
        for rank in range(tp):
            names = {n for u in units if rank in u.ranks for n in unit_tensors(u)}
            assert names == expected, (comp, rank, sorted(names ^ expected)[:5])


def test_an_nvfp4_scale_of_the_wrong_dtype_names_the_key_that_chooses_it(fixture_copy, tmp_path, capsys):
    """A block scale stored E8M0 where config.json's moe_quant_algo implies E4M3: one line naming the tensor and the
    key (the key's value was read as a config attribute once: a traceback)."""
    import struct

    src = fixture_copy("nvfp4")
    name = "layers.0.ffn.experts.1.w1.weight_scale"
    shard = src / json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][name]
    data = bytearray(shard.read_bytes())
    size = struct.unpack("<Q", data[:8])[0]
    header = data[8 : 8 + size].decode()
    edited = header.replace(f'"{name}":{{"dtype":"F8_E4M3"', f'"{name}":{{"dtype":"F8_E8M0"')
    assert edited != header and len(edited) == len(header)
    data[8 : 8 + size] = edited.encode()
    shard.write_bytes(bytes(data))
    for args in (("inspect", src), ("convert", src, tmp_path / "out")):
        code, _, err = run_cli(capsys, *args)
        assert code == 1 and "Traceback" not in err, err
        assert name in err and "moe_quant_algo 'NVFP4'" in err, err
    assert not (tmp_path / "out").exists()
