"""Target profiles: ``vllm-seed`` and ``vllm-norm-gate`` convert every good fixture and verify.

The expected names of ``vllm-norm-gate`` are computed here from the ``vllm-seed`` output with the four
renames of research/v4_format.md §3 (NEW vLLM: NormGateLinear), written as plain regexes rather than
read from ``ckpt_tool.rules``, so a wrong rule table cannot agree with itself.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ckpt_tool.cli import main
from ckpt_tool.convert import convert
from ckpt_tool.plan import Options
from ckpt_tool.verify import verify
from fixtures.make import GOOD_VARIANTS

PROFILE_NAMES = ("vllm-seed", "vllm-norm-gate")

# seed name → newer vLLM name; anchored on whole dot-separated segments
NORM_GATE = [
    (re.compile(r"^(model\.layers\.\d+\.(?:mtp_block\.)?)ffn_norm\.weight$"), r"\1ffn.norm_gate.norm.weight"),
    (re.compile(r"^(model\.layers\.\d+\.(?:mtp_block\.)?)ffn\.gate\.weight$"), r"\1ffn.norm_gate.gate.weight"),
    (re.compile(r"^(model\.layers\.\d+\.(?:mtp_block\.)?)ffn\.gate\.e_score_correction_bias$"), r"\1ffn.norm_gate.e_score_correction_bias"),
    (re.compile(r"^(model\.layers\.\d+\.(?:mtp_block\.)?)ffn\.gate\.tid2eid$"), r"\1ffn.norm_gate.tid2eid"),
]


def norm_gate_name(seed_name: str) -> str:
    for rx, repl in NORM_GATE:
        new, n = rx.subn(repl, seed_name)
        if n:
            return new
    return seed_name


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
def test_norm_gate_names_are_the_seed_names_with_four_renames(converted, variant: str, tp: int) -> None:
    seed = tensors_of(converted(variant, "vllm-seed", tp))
    new = tensors_of(converted(variant, "vllm-norm-gate", tp))
    assert set(seed) == set(new)
    renamed = 0
    for key, tensors in seed.items():
        expected = {norm_gate_name(n): t for n, t in tensors.items()}
        assert set(new[key]) == set(expected), key
        for name, t in expected.items():
            got = new[key][name]
            assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got.view(torch.uint8), t.view(torch.uint8)), name
        renamed += sum(norm_gate_name(n) != n for n in tensors)
    # every block (3 main layers + each MTP block) has ffn_norm + gate.weight + (bias | tid2eid), per rank
    assert renamed > 0
    for key, tensors in new.items():
        assert not any(".ffn_norm." in n or ".ffn.gate." in n for n in tensors), key
        assert all(".norm_gate." not in n for n in seed[key])


def test_norm_gate_covers_hash_layer_tid2eid_and_mtp_block(converted) -> None:
    new = tensors_of(converted("fp4", "vllm-norm-gate", 1))
    model, mtp = new[("model", 0)], new[("mtp", 0)]
    assert "model.layers.0.ffn.norm_gate.tid2eid" in model  # hash layer
    assert "model.layers.1.ffn.norm_gate.e_score_correction_bias" in model
    assert "model.layers.2.ffn.norm_gate.norm.weight" in model
    assert "model.layers.3.mtp_block.ffn.norm_gate.gate.weight" in mtp
    assert "model.layers.3.mtp_block.ffn.norm_gate.e_score_correction_bias" in mtp
    assert "model.layers.3.mtp_block.ffn.norm_gate.norm.weight" in mtp


def test_profiles_command_lists_both(capsys) -> None:
    assert main(["profiles"]) == 0
    lines = capsys.readouterr().out.splitlines()
    listed = [line.split()[0] for line in lines if line.strip()]
    assert listed == list(PROFILE_NAMES)


def test_unknown_target_is_rejected_naming_the_known_ones(fixture_dir, tmp_path, capsys) -> None:
    code = main(["convert", str(fixture_dir("fp4")), str(tmp_path / "out"), "--target", "vllm-nope"])
    err = capsys.readouterr().err
    assert code == 1 and "vllm-nope" in err and "vllm-norm-gate" in err
