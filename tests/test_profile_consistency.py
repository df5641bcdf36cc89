"""One place per profile: what a profile's rules write, the engine table verify holds OUT against and the
names numeric verification reads all derive from its module in ``ckpt_tool.mapping.profiles``, and agree.

The rules (renames, converts, pads) and the engine names are two independent statements of one layout; these
tests hold them equal on every profile, for every good fixture at tp 1/2/4 and under expert parallelism, from
the plan alone (no bytes written). That the engine names are vLLM's is proven per verified release in
tests/engine.
"""

from __future__ import annotations

import pytest

from ckpt_tool.checkpoint.source import open_checkpoint
from ckpt_tool.fixtures.make import GOOD_VARIANTS, VISION_VARIANTS
from ckpt_tool.mapping.engine_table import ENGINES, engine_params
from ckpt_tool.mapping.plan import Options
from ckpt_tool.mapping.planner import plan_conversion
from ckpt_tool.mapping.profiles import (
    ALIASES,
    DEFAULT_PROFILE,
    PROFILES,
    canonical_name,
    get_profile,
    newest_profile,
    series_of,
    verified_releases,
)  # fmt: skip
from ckpt_tool.verify.forward_names import CONVERTED_TENSORS

LAYOUTS = [(1, "tp"), (2, "tp"), (4, "ep"), (2, "ep")]


def _plan_tables(src, profile: str, tp: int, moe: str) -> dict[tuple[str, int], dict[str, tuple[tuple[int, ...], str]]]:
    ckpt = open_checkpoint(src)
    plan = plan_conversion(ckpt.require_config(), ckpt.tensors, Options(tp=tp, moe_parallel=moe, profile=profile))
    out: dict[tuple[str, int], dict[str, tuple[tuple[int, ...], str]]] = {}
    for f in plan.files:
        out.setdefault((f.component, f.rank), {}).update({t.name: (tuple(t.shape), t.dtype) for t in f.tensors})
    return out


def _disagreements(written: dict, expected: dict) -> list[str]:
    bad = [f"{n}: written by the rules, not in the engine table" for n in sorted(set(written) - set(expected))]
    bad += [f"{n}: in the engine table, not written by the rules" for n in sorted(set(expected) - set(written))]
    for n in sorted(set(written) & set(expected)):
        (shape, dtype), want = written[n], expected[n]
        if shape != want.shape or (want.dtype is not None and dtype != want.dtype):
            bad.append(f"{n}: rules write {dtype}{list(shape)}, engine table says {want.dtype}{list(want.shape)}")
    return bad


@pytest.mark.parametrize("profile", sorted(PROFILES))
@pytest.mark.parametrize("variant", GOOD_VARIANTS)  # the pad fixtures split under ep only: below
def test_rule_table_and_engine_table_agree_on_every_rank(fixture_dir, profile: str, variant: str) -> None:
    src = fixture_dir(variant)
    cfg = open_checkpoint(src).require_config()
    for tp, moe in LAYOUTS:
        for (comp, rank), written in _plan_tables(src, profile, tp, moe).items():
            bad = _disagreements(written, engine_params(cfg, profile, comp, tp, moe))
            assert not bad, (profile, variant, tp, moe, comp, rank, bad[:5])


VISION_LAYOUTS = [(1, "tp"), (2, "tp"), (4, "tp"), (2, "ep")]


@pytest.mark.parametrize("profile", sorted(PROFILES))
@pytest.mark.parametrize("variant", VISION_VARIANTS)
def test_rule_table_and_engine_table_agree_for_the_vision_model(fixture_dir, profile: str, variant: str) -> None:
    """The model class applies on top of every profile: the vision model's rules (prefix, bias_vl, the tower split
    or replicated) and its engine table agree on every rank."""
    src = fixture_dir(variant)
    cfg = open_checkpoint(src).require_config()
    assert cfg.is_vision
    for tp, moe in VISION_LAYOUTS:
        tables = _plan_tables(src, profile, tp, moe)
        assert {c for c, _r in tables} == ({"model", "mtp"} if cfg.num_nextn_predict_layers else {"model"})
        for (comp, rank), written in tables.items():
            bad = _disagreements(written, engine_params(cfg, profile, comp, tp, moe))
            assert not bad, (profile, variant, tp, moe, comp, rank, bad[:5])
            if comp == "model":
                assert any(n.startswith("language_model.") and n.endswith(".bias_vl") for n in written)
                assert "aligner.w1.weight" in written and "image_pad" in written


@pytest.mark.parametrize("variant,tp", [("fp4-pad", 2), ("fp4-pad", 4), ("fp8-e8m0-pad", 2)])
def test_padding_profiles_agree_on_padded_shared_experts(fixture_dir, variant: str, tp: int) -> None:
    src = fixture_dir(variant)
    cfg = open_checkpoint(src).require_config()
    padding = [name for name, p in PROFILES.items() if p.pads]
    assert padding, "no profile pads any more: drop this test"
    for profile in padding:
        assert get_profile(profile).engine.shared_pad, (
            f"{profile} pads shared experts in its rules, not in its engine table"
        )
        for (comp, rank), written in _plan_tables(src, profile, tp, "ep").items():
            bad = _disagreements(written, engine_params(cfg, profile, comp, tp, "ep"))
            assert not bad, (profile, variant, tp, comp, rank, bad[:5])


@pytest.mark.parametrize("profile", sorted(PROFILES))
@pytest.mark.parametrize("variant", ["fp4", "fp8", "fp4-2mtp"])
def test_numeric_names_are_engine_parameters(fixture_dir, profile: str, variant: str) -> None:
    """Every name the MTP forward reads (a tensor, or a linear's weight and scale) is in the engine table."""
    cfg = open_checkpoint(fixture_dir(variant)).require_config()
    scale = "weight_scale" if cfg.expert_dtype == "fp4" else "weight_scale_inv"
    table = engine_params(cfg, profile, "mtp", 2, "tp")
    linears = {"e_proj", "h_proj", "fused_wqa_wkv", "wq_b", "wo_a", "wo_b", "gate_up_proj", "down_proj"}
    for S in cfg.mtp_layer_ids:
        for role, template in CONVERTED_TENSORS[profile].items():
            name = template.format(S=S)
            if role == "experts":
                wanted = [f"{name}.w13_weight", f"{name}.w13_{scale}", f"{name}.w2_weight", f"{name}.w2_{scale}"]
            elif role in linears:
                wanted = [f"{name}.weight", f"{name}.weight_scale_inv"]
            else:
                wanted = [name]
            missing = [n for n in wanted if n not in table]
            assert not missing, (profile, role, missing)


def test_every_profile_has_one_engine_table_and_one_numeric_table() -> None:
    assert set(ENGINES) == set(CONVERTED_TENSORS) == set(PROFILES)
    for name, p in PROFILES.items():
        assert ENGINES[name] is p.engine


def test_aliases_name_profiles_and_never_shadow_one() -> None:
    assert not set(ALIASES) & set(PROFILES)
    for alias, name in ALIASES.items():
        assert canonical_name(alias) == name and get_profile(alias) is PROFILES[name]
    with pytest.raises(KeyError, match="vllm-0.33\\+"):
        get_profile("vllm-0.99")


def test_covered_series_and_verified_releases_agree() -> None:
    """A profile covers exactly the series of the releases it is verified against, no series is covered twice,
    and the default is the profile of the newest series."""
    seen: dict[tuple[int, int], str] = {}
    for p in PROFILES.values():
        covered = {series_of(c) for c in p.covers}
        assert None not in covered, p.covers
        assert covered == {series_of(v) for v in p.verified}, (p.name, p.covers, p.verified)
        for s in covered:
            assert s not in seen, f"series {s} covered by {seen.get(s)} and {p.name}"
            seen[s] = p.name
    assert DEFAULT_PROFILE == newest_profile().name == seen[max(seen)]
    releases = [r for r, _ in verified_releases()]
    assert releases == sorted(releases, key=lambda v: tuple(map(int, v.split(".")))) and len(set(releases)) == len(
        releases
    )
