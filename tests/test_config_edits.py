"""Hand-edited config.json, generated: every key the tool reads (ckpt_tool.checkpoint.config_keys.RULES, as written
in each fixture's file) set to every JSON type (missing, null, booleans, negative, zero and huge integers, floats,
strings, lists too short, too long, out of range, reordered, objects), for the V4 (``fp4``), vision (``vl-fp4``),
DSpark (``dspark-fp4``), V4.1 (``v41``) and NVIDIA's NVFP4 export (``nvfp4``) fixtures. For each edit, ``inspect``
and ``convert`` (in-process) must either both exit 0 with a complete OUT, where :func:`harmless` says the edit is
harmless, or both exit 1 with one line on stderr and no traceback, leaving no complete OUT; the source is never
touched.

:func:`harmless` decides by a stated rule, not by what the tool did. An edit is harmless when vLLM's loader builds
the very parameters of the unedited fixture from the edited config, which the engine matrix proves it loads:

1. the value is the same JSON value (same type) as before;
2. the key only matters at run time (:data:`RUNTIME`, ``qk_rope_head_dim``: no parameter's shape or presence depends
   on it) and the new value is one vLLM reads as such (the JSON type, the range, what its kernels assert);
3. vLLM does not read the key for this model class and draft (:data:`IGNORED`);
4. the key is removed (or set to null where vLLM reads null as absent) and vLLM's default equals the fixture's
   value, or set to the default where the fixture omits it (:data:`DEFAULTS`);
5. ``compress_ratios`` keeps the ratios that size a parameter (V4: every main layer's; V4.1: the source layers',
   :func:`_v41_ratios_harmless`) and every entry is a ratio vLLM accepts;
   ``engram_vocab_size`` moves where no prime lies between (vLLM's EngramLayout draws the same bucket primes);
   ``quantization_config.moe_quant_algo`` is a string (or null, or absent) that vLLM upper-cases to the same
   algorithm; ``quantization_config.ignore`` is a list of strings (or null, or absent) that leaves the same expert
   blocks in DeepSeek's format, matched as vLLM matches them (``fnmatchcase`` on ``{block}.ffn.experts``), or any
   value where ``moe_quant_algo`` is not NVFP4 (vLLM does not read it then).

Everything else changes what vLLM would build or is a value it cannot read: it must be refused.

Bounded for CI: a fixed number of examples, derandomized (the same edits every run), no deadline. A counter-example
found once stays below as a regular test (``test_found_*``).
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
from pathlib import Path

import pytest
from cli_helpers import run_cli, snapshot
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt_tool.checkpoint.config import V4Config, flatten_v41
from ckpt_tool.checkpoint.config_keys import MAX_COUNT, RULES, classes_of, key_in_file, rules_for
from ckpt_tool.fixtures.make import VARIANTS, VISION_DIM, make_config, v41_engram_head_sizes

FIXTURES = ("fp4", "vl-fp4", "dspark-fp4", "v41", "nvfp4")
EXAMPLES = int(os.environ.get("CONFIG_EDIT_EXAMPLES", "75"))
MISSING = object()


def _flat(doc: dict) -> dict:
    return flatten_v41(doc, "config.json") if doc.get("model_type") == "deepseek_v41" else doc


def _paths(variant: str) -> list[tuple[str, ...]]:
    """Every key the tool reads for ``variant``, as a path into its config.json (V4.1's nested ones included)."""
    doc = make_config(VARIANTS[variant])
    paths = []
    for rule in rules_for(classes_of(_flat(doc))):
        paths.append(tuple(key_in_file(doc, rule.key).split(".")))
    if variant == "v41":
        paths += [("text_config",), ("vision_config",)]
    return list(dict.fromkeys(paths))


PATHS = {v: _paths(v) for v in FIXTURES}


def _get(doc: dict, path: tuple[str, ...]):
    for key in path:
        if not isinstance(doc, dict) or key not in doc:
            return MISSING
        doc = doc[key]
    return doc


def _set(doc: dict, path: tuple[str, ...], value) -> dict:
    doc = copy.deepcopy(doc)
    node = doc
    for key in path[:-1]:
        node = node.setdefault(key, {})
    if value is MISSING:
        node.pop(path[-1], None)
    else:
        node[path[-1]] = value
    return doc


# --- the rule -----------------------------------------------------------------------------------------------------


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v) -> bool:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an integer past any float: JSON allows it
        return False


def _positive_int(v) -> bool:
    return _int(v) and v >= 1


# key -> (what vLLM reads at run time, whether the key may be absent: vLLM and the tool have a default)
RUNTIME = {
    "hc_eps": (_number, True),
    "routed_scaling_factor": (_number, True),
    "swiglu_limit": (_number, True),
    "rope_theta": (_number, True),
    "rms_norm_eps": (lambda v: _number(v) and v > 0, False),
    "scoring_func": (lambda v: isinstance(v, str), True),
    "norm_topk_prob": (lambda v: isinstance(v, bool), True),
    "sliding_window": (_positive_int, True),
    "hc_sinkhorn_iters": (_positive_int, True),
    "quantization_config.scale_fmt": (lambda v: isinstance(v, str), True),
    "dspark_block_size": (_positive_int, False),  # the serve line's number: the tool asks for it
    "block_size": (_positive_int, True),
    "dspark_noise_token_id": (lambda v: _int(v) and 0 <= v < 512, True),  # the fixtures' vocab: 512
    "engram_pad_token_id": (lambda v: _int(v) and v >= 0, False),  # vLLM reads it without a default
    # the vision tower's heads size no parameter at tp 1 (wqkv is [3 x vision_dim, vision_dim] whatever the split;
    # vllm/models/deepseek_v4/common/vision.py), as long as they divide vision_dim. V4 reads the key without a
    # default; V4.1's config class gives 16 (vllm/transformers_utils/configs/deepseek_v41.py), which divides 64
    "vision_n_heads": (lambda v: _positive_int(v) and VISION_DIM % v == 0, False),
    "vision:num_attention_heads": (lambda v: _positive_int(v) and VISION_DIM % v == 0, True),
}
# (fixture, key) -> what vLLM reads there, for a key vLLM does not read for that model class and draft
IGNORED = {
    # V4's DSpark draft counts n_mtp_layers (nvidia/dspark.py: `n_mtp_layers or 3`), never num_nextn_predict_layers
    ("dspark-fp4", "num_nextn_predict_layers"): lambda v: _int(v) and 0 <= v <= MAX_COUNT,
    # V4.1's draft: n_mtp_layers first (deepseek_v41/nvidia/dspark.py), and it is given
    ("v41", "num_nextn_predict_layers"): lambda v: _int(v) and 0 <= v <= MAX_COUNT,
    # V4.1 has no hash layers (deepseek_v41/nvidia/model.py passes num_hash_layers=0)
    ("v41", "num_hash_layers"): lambda v: v is MISSING or _int(v),
    # ... so the experts a token takes size no tensor (V4's hash table ffn.gate.tid2eid is [vocab, top-k]): routing
    # at run time only, 1 up to the experts (8 in the main layers, 16 in the draft's; null or absent in the draft:
    # the main layers' 2, nvidia/model.py)
    ("v41", "num_experts_per_tok"): lambda v: _int(v) and 1 <= v <= 8,
    ("v41", "dspark_num_experts_per_tok"): lambda v: v is MISSING or v is None or (_int(v) and 1 <= v <= 16),
}
# key -> vLLM's default where the key is absent (and null, where vLLM reads null as absent: NULL_IS_DEFAULT)
DEFAULTS = {
    "expert_dtype": "fp4",  # vllm/models/deepseek_v4/quant_config.py: getattr(hf_config, "expert_dtype", "fp4")
    "enable_confidence_head": True,  # nvidia/dspark.py: getattr(config, "enable_confidence_head", True)
    "n_mtp_layers": 3,  # V4: `or 3`; V4.1: `or num_nextn_predict_layers (3) or 3`
    "draft_vocab_size": 512,  # nvidia/dspark.py: `getattr(config, "draft_vocab_size", None) or config.vocab_size`
    # V4.1 without it: vLLM's DeepseekV41Config leaves expert_dtype unset and quant_config.py reads "fp4"
    "quantization_config.expert_dtype": "fp4",
}
NULL_IS_DEFAULT = {"n_mtp_layers", "draft_vocab_size"}


def _ratios_harmless(variant: str, old: list, new) -> bool:
    if not isinstance(new, list) or not all(_int(r) for r in new):
        return False
    layers = 4 if variant == "v41" else 3
    if variant == "v41":
        return _v41_ratios_harmless(old, new, layers)
    # transformers' DeepseekV4Config maps every entry (0, 4, 128), vLLM reads layer_types[layer] for each main layer
    return all(r in (0, 4, 128) for r in new) and len(new) >= layers and new[:layers] == old[:layers]


def _v41_ratios_harmless(old: list, new: list, layers: int) -> bool:
    """V4.1 (vllm/models/deepseek_v41/attention.py, compressor.py): each ratio 0, 1 or 2 (a layer past the list reads
    0). The source layer ids, not the ratios, place the compressors and indexers; a ratio shapes a parameter only
    on a kv source (its compressor has a gate for ratio 2). So the parameters stay the fixture's when each kv source
    keeps a ratio of 1 or 2 with or without the gate as before, each index source a ratio above 0 (the indexer
    divides by it), and every compressed layer a kv and an index source at or below it; a non-source layer's ratio
    decides only which compressed cache it reads at run time."""
    if not all(r in (0, 1, 2) for r in new):
        return False
    text = make_config(VARIANTS["v41"])["text_config"]
    kv, index = text["kv_source_layer_ids"], text["index_source_layer_ids"]

    def ratio(ratios, layer):
        return ratios[layer] if layer < len(ratios) else 0

    return (
        all(ratio(new, s) in (1, 2) and (ratio(new, s) > 1) == (ratio(old, s) > 1) for s in kv)
        and all(ratio(new, s) > 0 for s in index)
        and all(min(kv) <= layer and min(index) <= layer for layer, r in enumerate(new) if r > 0)
        and len(old) >= layers
    )


# V4.1's config class copies text_config with no defaults: what its model reads as config.key must be there
V41_NO_DEFAULT = {"sliding_window", "hc_sinkhorn_iters", "hc_eps", "swiglu_limit", "norm_topk_prob"}
# V4's transformers DeepseekV4Config defaults (configuration_deepseek_v4.py), the tool's too
V4_DEFAULTS = {"index_n_heads": 64, "index_head_dim": 128}


def harmless(variant: str, path: tuple[str, ...], old, new) -> bool:
    """Whether setting ``path`` from ``old`` to ``new`` (MISSING: removed) is harmless, by the rule above."""
    key = ".".join(path)
    flat_key = path[-1] if path[0] in ("text_config",) else key
    if path[0] == "vision_config":
        flat_key = "vision:" + path[-1]
    if (old is MISSING and new is MISSING) or (
        old is not MISSING and new is not MISSING and json.dumps(old) == json.dumps(new)  # 0.0 is not 0 in JSON
    ):
        return True
    if flat_key in RUNTIME:
        ok, may_be_absent = RUNTIME[flat_key]
        if new is MISSING:
            return may_be_absent and not (variant == "v41" and flat_key in V41_NO_DEFAULT)
        return ok(new)
    if (variant, flat_key) in IGNORED:
        return IGNORED[(variant, flat_key)](new)
    defaults = DEFAULTS if variant == "v41" else {**DEFAULTS, **V4_DEFAULTS}
    if flat_key in defaults:  # what vLLM reads before and after the edit
        default = defaults[flat_key]
        before = default if old is MISSING else old
        after = default if new is MISSING or (new is None and flat_key in NULL_IS_DEFAULT) else new
        return type(before) is type(after) and before == after
    if flat_key == "compress_ratios":
        return _ratios_harmless(variant, old, new)
    if flat_key == "qk_rope_head_dim":  # sizes no parameter: rotary pairs below head_dim; V4.1's compressor wants 64
        head_dim = _flat(make_config(VARIANTS[variant]))["head_dim"]
        return _int(new) and 2 <= new < head_dim and new % 2 == 0 and (variant != "v41" or new == 64)
    if key == "quantization_config.moe_quant_algo":
        return _algo(new) is not None and _algo(new) == _algo(old)
    if key == "quantization_config.ignore":
        if _algo(_get(make_config(VARIANTS[variant]), ("quantization_config", "moe_quant_algo"))) != "NVFP4":
            return True  # vLLM reads it only for NVFP4 experts
        return _left_out(variant, new) is not None and _left_out(variant, new) == _left_out(variant, old)
    if flat_key == "engram_vocab_size":  # only where the bucket primes start: the same first prime, the same tables
        return _int(new) and 2 <= new <= 10**6 and _next_prime(new) == v41_engram_head_sizes()[0][0]
    return False


def _algo(value) -> str | None:
    """The algorithm vLLM reads from moe_quant_algo (``(value or "").upper()``); None: a value of another JSON type."""
    if value is MISSING or value is None:
        return ""
    return value.upper() if isinstance(value, str) else None


def _left_out(variant: str, ignore) -> frozenset[str] | None:
    """The expert blocks ``ignore`` leaves in DeepSeek's format (vLLM's _is_nvfp4_expert_layer); None: not a list of
    strings."""
    from fnmatch import fnmatchcase

    if ignore is MISSING or ignore is None:
        ignore = []
    if not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore):
        return None
    config = make_config(VARIANTS[variant])
    blocks = [f"layers.{i}" for i in range(config["num_hidden_layers"])]
    blocks += [f"mtp.{i}" for i in range(config["num_nextn_predict_layers"])]
    return frozenset(b for b in blocks if any(fnmatchcase(f"{b}.ffn.experts", p) for p in ignore))


def _next_prime(n: int) -> int:
    """The smallest prime >= n (trial division: n is small here)."""
    while n < 2 or any(n % d == 0 for d in range(2, math.isqrt(n) + 1)):
        n += 1
    return n


# --- the edits ----------------------------------------------------------------------------------------------------


@st.composite
def config_edits(draw):
    """(fixture, path, old value, new value): one key of one fixture's config.json set to a generated JSON value."""
    variant = draw(st.sampled_from(FIXTURES))
    path = draw(st.sampled_from(PATHS[variant]))
    old = _get(make_config(VARIANTS[variant]), path)
    base = old if _int(old) else 3
    ints = st.one_of(
        st.sampled_from([0, -1, base - 1, base + 1, base + 3, 2**31, 10**12, 10**400]),
        st.integers(-(2**40), 2**40),
    )
    lists = st.just([])
    if isinstance(old, list) and old:
        lists = st.sampled_from(
            [
                [],
                old[:-1],
                [*old, old[-1]],
                [*old, max(old) + 1] if all(_int(x) for x in old) else [*old, 1],
                [old[0] + 100 if _int(old[0]) else 1, *old[1:]],
                [str(old[0]), *old[1:]],
                [float(old[0]) if _int(old[0]) else 0.5, *old[1:]],
                [True, *old[1:]],
                list(reversed(old)),
                [old[-1], *old[1:]],  # the last id twice
                [old],
            ]
        )
    new = draw(
        st.one_of(
            st.just(MISSING),
            st.none(),
            st.booleans(),
            ints,
            st.sampled_from([float(base), base + 0.5, -1.5]),
            st.floats(allow_nan=False, allow_infinity=False),
            st.sampled_from([str(base), "x", "", json.dumps(old) if old is not MISSING else "null"]),
            lists,
            st.just({}),
        )
    )
    return variant, path, old, new


@pytest.fixture(scope="module")
def editable(fixture_dir, tmp_path_factory):
    """``editable(variant)`` -> a source whose shards are the fixture's (hard links) and whose config.json each example
    rewrites."""
    root = tmp_path_factory.mktemp("edited")
    made: dict[str, Path] = {}

    def get(variant: str) -> Path:
        if variant not in made:
            src, dst = fixture_dir(variant), root / variant
            dst.mkdir()
            for f in src.iterdir():
                if f.is_file() and f.name != "config.json":
                    os.link(f, dst / f.name)
            made[variant] = dst
        return made[variant]

    return get


def check_edit(editable, capsys, tmp_path: Path, variant: str, path: tuple[str, ...], new) -> None:
    """Apply one edit and require the verdict :func:`harmless` names."""
    good = make_config(VARIANTS[variant])
    old = _get(good, path)
    src = editable(variant)
    (src / "config.json").write_text(json.dumps(_set(good, path, new), indent=2))
    before = snapshot(src)
    out = tmp_path / "out"
    shutil.rmtree(out, ignore_errors=True)
    want = 0 if harmless(variant, path, old, new) else 1
    case = f"{variant}: {'.'.join(path)} {'(removed)' if new is MISSING else json.dumps(new)} (was {old!r})"
    for args in (("inspect", src), ("convert", src, out, "--tp", "1")):
        code, _, err = run_cli(capsys, *args)
        assert code == want, f"{case}: {args[0]} exited {code}, the rule says {want}:\n{err}"
        assert "Traceback" not in err, f"{case}: {args[0]}:\n{err}"
        if want == 1:
            lines = [line for line in err.splitlines() if line.strip()]
            assert len(lines) == 1 and lines[0].startswith("error: "), f"{case}: {args[0]}:\n{err}"
    manifest = out / "ckpt-tool.json"
    complete = manifest.is_file() and json.loads(manifest.read_text()).get("complete") is True
    assert complete == (want == 0), f"{case}: OUT complete: {complete}"
    if want == 0:  # OUT carries the config.json it was converted from, byte for byte
        assert (out / "model" / "config.json").read_bytes() == (src / "config.json").read_bytes()
    assert snapshot(src) == before, f"{case}: the source changed"


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(edit=config_edits())
def test_a_generated_config_edit_is_converted_whole_or_refused_in_one_line(editable, capsys, tmp_path, edit) -> None:
    variant, path, _old, new = edit
    check_edit(editable, capsys, tmp_path, variant, path, new)


def test_every_key_the_config_reads_has_a_rule() -> None:
    """The keys config.py, the draft kind and expert_format read from config.json (found in their source) are all in
    the table, so the edits above reach them."""
    import re

    import ckpt_tool.checkpoint.config as config_module
    import ckpt_tool.checkpoint.expert_format as expert_format_module
    import ckpt_tool.mapping.profiles.draft_kind as draft_module

    modules = (config_module, draft_module, expert_format_module)
    text = "".join(Path(m.__file__).read_text() for m in modules)
    read = set(re.findall(r"""(?:raw|quant|flat)(?:\.get\(|\[)"([a-z_0-9]+)""", text))
    read |= set(re.findall(r"""_flat_get\(config\.raw, "([a-z_0-9]+)"\)""", text))
    read -= {"text_config", "vision_config"}  # the V4.1 nesting itself: edited as a whole above
    ruled = {r.key.split(".")[-1] for r in RULES}
    assert read - ruled == set(), read - ruled


# --- the two cases of issue 45, and counter-examples the generator found -------------------------------------------

FOUND = [
    ("dspark-fp4", ("dspark_target_layer_ids",), [0, 1, 6]),  # issue 45: a layer past the model, exit 0 before
    ("v41", ("text_config", "engram_layer_ids"), [1, 2, 3]),  # issue 45: IndexError before
    ("fp4", ("quantization_config",), MISSING),  # vLLM would build every linear unquantized: exit 0 before
    ("v41", ("text_config", "dspark_num_experts_per_tok"), MISSING),  # harmless: the main layers' top-k
    ("v41", ("draft_vocab_size",), None),  # harmless: vLLM reads null as vocab_size
    ("fp4", ("num_hidden_layers",), 0),  # inspect said ok: the layers past the model were judged by no one
    ("fp4", ("num_hash_layers",), 2**40),  # a set of every layer number below it: killed for memory
    ("fp4", ("num_nextn_predict_layers",), 0),  # inspect said ok (convert refused): mtp.0 judged by no one
    ("fp4", ("n_shared_experts",), 0),  # inspect said ok: the shared experts stored were judged by no one
    ("v41", ("draft_vocab_size",), 2),  # V4.1's markov_head.head is [draft_vocab_size, rank]: it was not checked
    ("v41", ("text_config", "engram_vocab_size"), 511),  # harmless: the first prime at or above it is 521 all the same
    # buckets from the prime 2 fit in the stored tables (vLLM asserts only that) but reach a sliver of their rows:
    # accepted before, the served Engram would have looked up rows the table was not trained for
    ("v41", ("text_config", "engram_vocab_size"), 2),
    ("fp4", ("index_head_dim",), MISSING),  # harmless: transformers' default, 128
    ("v41", ("text_config", "index_head_dim"), MISSING),  # V4.1 has no default: exit 0 before
    ("v41", ("text_config", "hc_eps"), MISSING),  # the same
    # layers 1-2 stored with a compressor (and layer 1 an indexer) read as ratio 0: vLLM builds neither, its sharded
    # loader would refuse the keys; convert wrote them, complete, before
    ("dspark-fp4", ("compress_ratios",), [0, 0, 0, 128, 4, 0]),
    # V4.1: kv source 3 at ratio 2 wants a gate the checkpoint lacks; kv source 0 at 1 would leave its gate unloaded;
    # index source 1 at 0 divides by zero; non-source layer 2 at 1 only reads source 0's compressed cache (harmless)
    ("v41", ("text_config", "compress_ratios"), [2, 2, 0, 2, 0, 0, 0]),
    ("v41", ("text_config", "compress_ratios"), [1, 2, 0, 1, 0, 0, 0]),
    ("v41", ("text_config", "compress_ratios"), [2, 0, 0, 1, 0, 0, 0]),
    ("v41", ("text_config", "compress_ratios"), [2, 2, 1, 1, 0, 0, 0]),
    ("fp4", ("qk_rope_head_dim",), 63),  # sizes no parameter, but vLLM's rotary kernels assert an even count
    # sizes no tensor, but vLLM refuses to start when the tokenizer compresses to another count (engram_vocab)
    ("v41", ("text_config", "engram_compressed_vocab_size"), 511),
    ("v41", ("vision_config", "num_attention_heads"), MISSING),  # harmless: vLLM's 16 divides 64, sizes nothing
    # NVIDIA's NVFP4 export: which experts are NVFP4 (vLLM's _is_nvfp4_expert_layer)
    ("nvfp4", ("quantization_config", "ignore"), ["*.attn.*", "head"]),  # mtp.0's MXFP4 experts would be built NVFP4
    ("nvfp4", ("quantization_config", "ignore"), ["mtp.*", "head"]),  # harmless: the same blocks left out
    ("nvfp4", ("quantization_config", "ignore"), "mtp.*"),  # vLLM drops a non-list: every block NVFP4
    ("nvfp4", ("quantization_config", "ignore"), ["mtp.*", 1]),  # vLLM drops the 1: refused as ill-typed
    ("nvfp4", ("quantization_config", "moe_quant_algo"), "nvfp4"),  # harmless: vLLM upper-cases it
    ("nvfp4", ("quantization_config", "moe_quant_algo"), MISSING),  # MXFP4 would be built for NVFP4 experts
    ("fp4", ("quantization_config", "moe_quant_algo"), "NVFP4"),  # NVFP4 would be built for MXFP4 experts
    ("fp4", ("quantization_config", "moe_quant_algo"), False),  # vLLM's `or ""` takes it; the tool reads strings
    ("fp4", ("quantization_config", "ignore"), 7),  # harmless: not read without moe_quant_algo NVFP4
]


@pytest.mark.parametrize(("variant", "path", "new"), FOUND, ids=[f"{v}-{'.'.join(p)}" for v, p, _ in FOUND])
def test_a_found_edit_gets_the_verdict_the_rule_names(editable, capsys, tmp_path, variant, path, new) -> None:
    check_edit(editable, capsys, tmp_path, variant, path, new)


def test_every_fixture_config_is_accepted_as_it_is() -> None:
    for variant in FIXTURES:
        V4Config.from_dict(make_config(VARIANTS[variant]))
