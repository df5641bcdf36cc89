"""Target profiles: ``vllm-seed`` and ``vllm-0.33+`` convert every good fixture and verify; ``--target auto``.

The expected names and dtypes of ``vllm-0.33+`` are computed here from the ``vllm-seed`` output with the
renames and dtype changes vLLM 0.33's code implies (vllm/models/deepseek_v4/nvidia/model.py, sharded_state
loader), written as plain regexes rather than read from ``ckpt_tool.mapping.profiles``, so a wrong rule table cannot
agree with itself. (That vllm-0.33+ is what vLLM 0.33 and 0.34 load is proven by their own loaders in
tests/engine.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ckpt_tool.cli.entry import main
from ckpt_tool.fixtures.make import GOOD_VARIANTS
from ckpt_tool.mapping.plan import Options
from ckpt_tool.output.convert import convert
from ckpt_tool.verify.levels import verify

PROFILE_NAMES = ("vllm-seed", "vllm-0.33+")

# seed name → vLLM 0.33 sharded_state key; anchored on whole dot-separated segments
V033 = [
    (re.compile(r"\.attn\.mla_attn\.compressor\."), ".attn.compressor."),
    (re.compile(r"\.ffn\.gate\."), ".ffn.experts.gate."),
    (re.compile(r"\.ffn\.shared_experts\."), ".ffn.experts._shared_experts._layer."),
    (re.compile(r"\.ffn\.experts\.(w13_|w2_)"), r".ffn.experts.routed_experts.\1"),
]


def v033_name(seed_name: str) -> str:
    for rx, repl in V033:
        new, n = rx.subn(repl, seed_name)
        if n:
            return new
    return seed_name


def v033_tensor(name: str, t: torch.Tensor, expert_dtype: str) -> torch.Tensor:
    """The seed output tensor (``vllm-seed``, docs/profiles.md#the-seed) as vLLM 0.33's parameter holds it."""
    if name.endswith(".tid2eid"):
        return t.to(torch.int32)
    if expert_dtype == "fp8" and name.endswith(".weight_scale_inv") and t.dtype == torch.float8_e8m0fnu:
        return t.to(torch.float32)
    return t


def tensors_of(out: Path) -> dict[tuple[str, int], dict[str, torch.Tensor]]:
    """{(component, rank): {name: tensor}} of a converted folder."""
    res: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    for comp in ("model", "mtp"):
        index = json.loads((out / comp / "index.json").read_text())
        for rank, names in index["ranks"].items():
            d = res.setdefault((comp, int(rank)), {})
            for name, file in names.items():
                with safe_open(str(out / comp / file), framework="pt") as fh:
                    d[name] = fh.get_tensor(name)
    return res


@pytest.fixture(scope="module")
def converted(fixture_dir, tmp_path_factory):
    """``converted(variant, profile, tp)`` -> a converted folder (built once per module)."""
    root = tmp_path_factory.mktemp("profiles")
    _CONVERTED: dict[tuple[str, str, int], Path] = {}

    def get(variant: str, profile: str, tp: int) -> Path:
        key = (variant, profile, tp)
        if key not in _CONVERTED:
            out = root / f"{variant}-{profile}-tp{tp}"
            convert(fixture_dir(variant), out, Options(tp=tp, profile=profile))
            _CONVERTED[key] = out
        return _CONVERTED[key]

    return get


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("variant", GOOD_VARIANTS)
@pytest.mark.parametrize("profile", PROFILE_NAMES)
def test_every_profile_converts_and_verifies(converted, fixture_dir, variant: str, profile: str, tp: int) -> None:
    out = converted(variant, profile, tp)
    manifest = json.loads((out / "ckpt-tool.json").read_text())
    assert manifest["profile"] == profile and manifest["complete"] is True
    report = verify(out, fixture_dir(variant), level="numeric", kernels="torch", device="cpu", tokens=8)
    assert report.ok, [c.message for c in report.failures]
    assert any(c.name.startswith("numeric:") for c in report.checks)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("variant", GOOD_VARIANTS)
def test_v033_is_the_seed_layout_renamed_with_engine_dtypes(converted, fixture_dir, variant: str, tp: int) -> None:
    expert_dtype = json.loads((fixture_dir(variant) / "config.json").read_text())["expert_dtype"]
    seed = tensors_of(converted(variant, "vllm-seed", tp))
    new = tensors_of(converted(variant, "vllm-0.33+", tp))
    assert set(seed) == set(new)
    for key, tensors in seed.items():
        expected = {v033_name(n): v033_tensor(n, t, expert_dtype) for n, t in tensors.items()}
        assert set(new[key]) == set(expected), key
        for name, t in expected.items():
            got = new[key][name]
            assert got.dtype == t.dtype and got.shape == t.shape, name
            assert torch.equal(got.view(torch.uint8), t.contiguous().view(torch.uint8)), name


PADDED = [
    ("fp4-pad", 2, "ep"),
    ("fp4-pad", 4, "ep"),
    ("fp8-e8m0-pad", 2, "ep"),
]  # MXFP4 experts at 192/96 rows a rank: ep only


@pytest.mark.parametrize("variant,tp,moe", PADDED, ids=[f"{v}-tp{t}-{m}" for v, t, m in PADDED])
def test_v033_zero_pads_shared_experts_as_vllm_loads_them(
    fixture_dir, tmp_path, variant: str, tp: int, moe: str
) -> None:
    """3-block shared experts at tp 2/4: the SPEC expectation with vLLM 0.33's pad-then-split of every shared-expert
    weight and scale (zeros in the source dtype: an E8M0 zero in a float32 parameter is 2^-127), renamed."""
    from test_convert import expected_outputs, read_component

    src = fixture_dir(variant)
    expert_dtype = json.loads((src / "config.json").read_text())["expert_dtype"]
    out = tmp_path / "out"
    convert(src, out, Options(tp=tp, moe_parallel=moe, profile="vllm-0.33+"))
    blocks_a_rank = -(-3 // tp)  # cdiv(384 / 128, tp): more than 3 / tp, the rest zeros
    for comp in ("model", "mtp"):
        got = read_component(out / comp)
        for rank in range(tp):
            want = {
                v033_name(n): v033_tensor(n, t, expert_dtype)
                for n, t in expected_outputs(src, tp, rank, moe, pad_shared=True)[comp].items()
            }
            assert set(got[rank]) == set(want), (comp, rank)
            for name, t in want.items():
                have = got[rank][name][1]
                assert have.dtype == t.dtype and have.shape == t.shape, (comp, rank, name, have.shape, t.shape)
                assert torch.equal(have.contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)), (
                    comp,
                    rank,
                    name,
                )
                if name.endswith("_shared_experts._layer.gate_up_proj.weight"):
                    assert t.shape[0] == 2 * blocks_a_rank * 128
    report = verify(out, src, level="values")
    assert report.ok, [c.message for c in report.failures]


def test_v033_layout_of_hash_layer_compressor_and_mtp_block(converted) -> None:
    new = tensors_of(converted("fp4", "vllm-0.33+", 1))
    model, mtp = new[("model", 0)], new[("mtp", 0)]
    assert model["model.layers.0.ffn.experts.gate.tid2eid"].dtype == torch.int32  # hash layer
    assert "model.layers.1.ffn.experts.gate.e_score_correction_bias" in model
    assert "model.layers.1.attn.compressor.ape" in model and "model.layers.1.attn.indexer.compressor.ape" in model
    assert "model.layers.2.ffn.experts.routed_experts.w13_weight" in model
    assert "model.layers.3.mtp_block.ffn.experts._shared_experts._layer.down_proj.weight" in mtp
    assert not any(".mla_attn." in n or ".ffn.gate." in n or ".ffn.shared_experts." in n for n in model)


def test_fp8_expert_checkpoints_get_float32_linear_scales(converted) -> None:
    model = tensors_of(converted("fp8-e8m0", "vllm-0.33+", 1))[("model", 0)]
    scales = {n: t.dtype for n, t in model.items() if "scale" in n}
    assert scales and set(scales.values()) == {torch.float32}
    fp4 = tensors_of(converted("fp4", "vllm-0.33+", 1))[("model", 0)]
    assert (
        fp4["model.layers.0.attn.wq_b.weight_scale_inv"].dtype == torch.float8_e8m0fnu
    )  # E8M0 params with fp4 experts


def test_profiles_command_lists_every_profile_with_its_verified_releases_and_aliases(capsys) -> None:
    assert main(["profiles"]) == 0
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.splitlines() if line.strip() and not line.startswith((" ", "--target"))]
    assert listed == list(PROFILE_NAMES)
    assert "verified against vLLM 0.33.0, 0.34.0 (also: vllm-0.33)" in out
    assert "shared/" not in out and "seeds" not in out  # speaks of things a user has
    assert main(["profiles", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in doc["profiles"]] == list(PROFILE_NAMES)
    assert {p["name"]: p["vllm_verified"] for p in doc["profiles"]} == {
        "vllm-seed": [],
        "vllm-0.33+": ["0.33.0", "0.34.0"],
    }
    assert {p["name"]: p["vllm_covers"] for p in doc["profiles"]} == {
        "vllm-seed": [],
        "vllm-0.33+": ["0.33.x", "0.34.x"],
    }
    assert {p["name"]: p["aliases"] for p in doc["profiles"]} == {"vllm-seed": [], "vllm-0.33+": ["vllm-0.33"]}


def test_unknown_target_is_a_usage_error_naming_the_known_ones(fixture_dir, tmp_path, capsys) -> None:
    code = main(["convert", str(fixture_dir("fp4")), str(tmp_path / "out"), "--target", "vllm-nope"])
    err = capsys.readouterr().err
    assert code == 2 and "vllm-nope" in err and "vllm-0.33+" in err and "vllm-seed" in err
    assert not (tmp_path / "out").exists()


def test_the_earlier_profile_name_still_works_and_the_manifest_records_the_current_one(
    fixture_dir, tmp_path, capsys
) -> None:
    code = main(["convert", str(fixture_dir("fp4")), str(tmp_path / "out"), "--only", "mtp", "--target", "vllm-0.33"])
    assert code == 0, capsys.readouterr().err
    manifest = json.loads((tmp_path / "out" / "ckpt-tool.json").read_text())
    assert manifest["profile"] == manifest["options"]["profile"] == manifest["target"]["profile"] == "vllm-0.33+"
    assert Options(profile="vllm-0.33") == Options(profile="vllm-0.33+")


def test_an_out_whose_manifest_names_the_earlier_profile_still_verifies(fixture_dir, tmp_path) -> None:
    """OUTs written before the rename record ``vllm-0.33``: verify (and resume, unconvert) read it as the profile."""
    src, out = fixture_dir("fp4"), tmp_path / "out"
    convert(src, out, Options(tp=2, only="mtp"))
    path = out / "ckpt-tool.json"
    manifest = json.loads(path.read_text())
    manifest["profile"] = manifest["options"]["profile"] = "vllm-0.33"
    path.write_text(json.dumps(manifest))
    report = verify(out, src, level="values")
    assert report.ok, [c.message for c in report.failures]


# ---------------------------------------------------------------------------------------------
# --target auto: from the installed vLLM's package metadata (vLLM is never imported)


def test_auto_without_vllm_takes_the_newest_profile_and_says_so(fixture_dir, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr("ckpt_tool.mapping.target.installed_vllm", lambda: None)
    code = main(["convert", str(fixture_dir("fp4")), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 0, err
    notes = [line for line in err.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and "no vLLM installed" in notes[0] and "vllm-0.33+" in notes[0]
    assert "warning" not in err
    manifest = json.loads((tmp_path / "out" / "ckpt-tool.json").read_text())
    assert manifest["profile"] == "vllm-0.33+"
    assert manifest["target"] == {
        "profile": "vllm-0.33+",
        "vllm_verified": ["0.33.0", "0.34.0"],
        "vllm_covers": ["0.33", "0.34"],
        "installed_vllm": None,
        "verified": None,
    }


@pytest.mark.parametrize("version", ["0.33.0", "0.33.2", "0.33.1+cu130", "0.34.0", "0.34.1rc1"])
def test_auto_picks_the_profile_covering_the_installed_vllm_without_a_word(
    fixture_dir, tmp_path, capsys, monkeypatch, version: str
) -> None:
    monkeypatch.setattr("ckpt_tool.mapping.target.installed_vllm", lambda: version)
    code = main(["convert", str(fixture_dir("fp4")), str(tmp_path / "out"), "--only", "mtp"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "warning" not in err and "note:" not in err
    manifest = json.loads((tmp_path / "out" / "ckpt-tool.json").read_text())
    assert manifest["profile"] == "vllm-0.33+" and manifest["target"]["installed_vllm"] == version
    assert manifest["target"]["verified"] is True


@pytest.mark.parametrize("version", ["0.35.0", "0.35.0rc1.dev12+g1234abc", "1.0.0"])
def test_auto_with_a_newer_vllm_takes_the_newest_profile_with_one_warning_and_marks_it(
    fixture_dir, tmp_path, capsys, monkeypatch, version: str
) -> None:
    monkeypatch.setattr("ckpt_tool.mapping.target.installed_vllm", lambda: version)
    src, out = fixture_dir("fp4"), tmp_path / "out"
    code = main(["convert", str(src), str(out), "--only", "mtp"])
    err = capsys.readouterr().err
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1, err
    assert version in warnings[0] and "not verified" in warnings[0] and "ckpt-tool verify OUT --engine" in warnings[0]
    manifest = json.loads((out / "ckpt-tool.json").read_text())
    assert manifest["profile"] == "vllm-0.33+"
    assert manifest["target"]["verified"] is False and manifest["target"]["installed_vllm"] == version

    # verify repeats the mark: a warning line, and target.verified in its JSON
    assert main(["verify", str(out), "--source", str(src), "--level", "structure"]) == 0
    err = capsys.readouterr().err
    assert sum(line.startswith("warning: ") for line in err.splitlines()) == 1 and version in err
    assert main(["verify", str(out), "--source", str(src), "--level", "structure", "--json"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["target"]["verified"] is False and doc["target"]["installed_vllm"] == version
    assert "warning: " in captured.err


def test_auto_with_a_newer_vllm_in_json_mode_carries_the_warning(fixture_dir, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr("ckpt_tool.mapping.target.installed_vllm", lambda: "0.35.0")
    code = main(["convert", str(fixture_dir("fp4")), str(tmp_path / "out"), "--only", "mtp", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    doc = json.loads(captured.out)
    assert "0.35.0" in doc["target_warning"] and doc["target_note"] is None
    assert captured.err.count("warning: ") == 1


@pytest.mark.parametrize("version", ["0.32.1", "0.10.0", "nightly"])
def test_auto_refuses_an_older_or_unreadable_vllm(fixture_dir, tmp_path, capsys, monkeypatch, version: str) -> None:
    monkeypatch.setattr("ckpt_tool.mapping.target.installed_vllm", lambda: version)
    code = main(["convert", str(fixture_dir("fp4")), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2
    assert version in err and "vllm-seed" in err and "vllm-0.33+" in err and "--target" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_env_and_profiles_say_whether_auto_is_verified_for_the_installed_vllm(capsys, monkeypatch) -> None:
    monkeypatch.setattr("ckpt_tool.mapping.target.installed_vllm", lambda: "0.36.2")
    assert main(["env", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["target_auto"] == "vllm-0.33+" and doc["target_auto_verified"] is False
    assert main(["profiles"]) == 0
    assert "NOT verified for vLLM 0.36.2" in capsys.readouterr().out
    monkeypatch.setattr("ckpt_tool.mapping.target.installed_vllm", lambda: "0.34.0")
    assert main(["profiles", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["auto"] == "vllm-0.33+" and doc["auto_verified"] is True and doc["auto_error"] is None


def test_the_installed_vllm_is_found_as_importlib_metadata_finds_it(tmp_path, monkeypatch) -> None:
    """The fast lookup (a folder name on sys.path, no importlib.metadata import, no vllm import) answers what
    importlib.metadata answers: the first sys.path folder's vllm-<version>.dist-info, or nothing."""
    import sys
    from importlib import metadata

    from ckpt_tool.mapping.target import installed_vllm

    first, second = tmp_path / "a", tmp_path / "b"
    for folder, version in ((first, "0.35.1"), (second, "0.33.0")):
        info = folder / f"vllm-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    (first / "vllm_flash_attn-2.0.dist-info").mkdir()  # another distribution whose name starts with vllm
    monkeypatch.setattr(sys, "path", [str(first), str(second), *sys.path])
    assert installed_vllm() == metadata.version("vllm") == "0.35.1"
    assert "vllm" not in sys.modules  # read from the metadata, never imported
    monkeypatch.setattr(sys, "path", [str(tmp_path / "missing"), *sys.path[2:]])
    try:
        expected = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        expected = None
    assert installed_vllm() == expected
