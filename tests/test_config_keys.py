"""config.json keys that name layers, stages, heads or sizes (ckpt_tool.checkpoint.config_keys): refused before
writing in one line naming the key, its value and what the model or the checkpoint holds; verify names the keys of a
source config.json changed since conversion; the serve line gives num_speculative_tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import run_cli, snapshot

from ckpt_tool.checkpoint.config import V4Config
from ckpt_tool.checkpoint.config_keys import RULES, check_values, classes_of
from ckpt_tool.errors import CheckpointError
from ckpt_tool.fixtures.make import DSPARK_BLOCK_SIZE, VARIANTS, make_config, v41_engram_num_embeddings


def _edited(fixture_copy, variant: str, **edits) -> Path:
    """A copy of ``variant`` whose config.json has ``edits`` (V4.1: in text_config)."""
    src = fixture_copy(variant)
    doc = json.loads((src / "config.json").read_text())
    (doc["text_config"] if "text_config" in doc else doc).update(edits)
    (src / "config.json").write_text(json.dumps(doc))
    return src


def _refused(capsys, src: Path, tmp_path: Path) -> list[str]:
    """inspect's and convert's one error line each; nothing written, the source untouched."""
    before = snapshot(src)
    lines = []
    for args in (("inspect", src), ("convert", src, tmp_path / "out", "--tp", "1")):
        code, _, err = run_cli(capsys, *args)
        got = [line for line in err.splitlines() if line.strip()]
        assert code == 1 and len(got) == 1 and "Traceback" not in err, (args[0], err)
        lines.append(got[0])
    assert not (tmp_path / "out" / "ckpt-tool.json").exists() and snapshot(src) == before
    return lines


# (variant, edits, what the one line must say)
REFUSED = [
    # issue 45: a target layer past the model converted to a complete OUT vLLM never feeds
    ("dspark-fp4", {"dspark_target_layer_ids": [0, 1, 6]},
     "dspark_target_layer_ids is [0, 1, 6] in config.json, but layer 6 is not among the model's layers 0-2 "
     "(num_hidden_layers 3)"),
    ("dspark-fp4", {"dspark_target_layer_ids": [0, 2, 2]}, "layer 2 is named twice"),
    ("dspark-fp4", {"dspark_target_layer_ids": [2, 1, 0]}, "not in ascending order"),
    # V4.1's ids are used as given: 1..N (layer 0 has no input to capture)
    ("v41", {"dspark_target_layer_ids": [0, 1, 2]}, "layer 0 is not among the layer boundaries vLLM V4.1 captures"),
    # issue 45: an IndexError before
    ("v41", {"engram_layer_ids": [1, 2, 3]},
     "text_config.engram_layer_ids is [1, 2, 3] in config.json, but engram_num_embeddings gives 2 table sizes for "
     "3 layers"),
    ("v41", {"engram_layer_ids": [1, 3]},
     "text_config.engram_layer_ids is [1, 3] in config.json, but the checkpoint holds Engram tables for layers 1-2"),
    ("v41", {"kv_source_layer_ids": [0, 1]},
     "text_config.kv_source_layer_ids is [0, 1] in config.json, but the checkpoint holds a compressor for layers 0, 3"),
    ("v41", {"kv_source_layer_ids": [0, 2]},
     "text_config.kv_source_layer_ids is [0, 2] in config.json, but compress_ratios gives source layer 2 ratio 0: "
     "vLLM's V4.1 compressor takes 1 or 2"),
    ("v41", {"index_source_layer_ids": [1, 3]}, "layer 0 has compress ratio 2 and no index source at or below it"),
    ("v41", {"engram_num_embeddings": [10, 10]}, "layer 1's table has 10 rows, fewer than its"),
    ("v41", {"engram_vocab_size": 2},
     f"text_config.engram_num_embeddings is {v41_engram_num_embeddings()} in config.json, but layer 1's 16 hash "
     "buckets (prime sizes from engram_vocab_size 2) reach only "),
    ("v41", {"index_head_dim": None}, "text_config.index_head_dim is null in config.json"),
    ("fp4", {"compress_ratios": [0, 128, 128, 0]},
     "compress_ratios is [0, 128, 128, 0] in config.json, but the checkpoint holds an indexer for layer 1, whose "
     "ratios it gives as 128 for layer 1 (vLLM builds an indexer only for ratio 4"),
    ("fp4", {"num_hash_layers": 0},
     "num_hash_layers is 0 in config.json, but the checkpoint holds a hash-routing table (ffn.gate.tid2eid) for "
     "layers 0"),
    ("fp4", {"num_hash_layers": -1}, "it must be at least 0"),
    ("fp4", {"n_shared_experts": 0}, "n_shared_experts is 0 in config.json, but the checkpoint holds shared experts "
     "in layers 0-2, for which vLLM would build no parameter"),
    ("dspark-fp4", {"enable_confidence_head": False}, "enable_confidence_head is false in config.json, but the "
     "checkpoint holds a confidence head (mtp.2.confidence_head.*)"),
    ("vl-fp4", {"vision_n_layers": 1}, "vision_n_layers is 1 in config.json, but the checkpoint holds vision tower "
     "blocks 0-1"),
    ("fp4", {"num_nextn_predict_layers": 0}, "num_nextn_predict_layers is 0 in config.json, but the checkpoint holds "
     "MTP layers mtp.0"),
    ("dspark-fp4", {"n_mtp_layers": 2}, "n_mtp_layers is 2 in config.json, but the checkpoint holds DSpark stages "
     "mtp.0-2"),
    ("fp4", {"num_hash_layers": 2**40}, "for layers 0"),  # once a set of 2**40 layer numbers: 20 GiB and the OOM killer
    ("fp4", {"num_hidden_layers": 2, "compress_ratios": [0, 4]},
     "num_hidden_layers is 2 in config.json, but the checkpoint holds layers 0-2"),
    ("fp4", {"compress_ratios": [0, 4, 64, 0]}, "ratio 64 is not one of 0 (sliding window), 4 (CSA) and 128 (HCA)"),
    ("fp4", {"compress_ratios": [0, 4]}, "it has 2 entries for 3 layers"),
    ("fp4", {"num_experts_per_tok": 9}, "it exceeds the 8 experts"),
    ("fp4", {"index_n_heads": "4"}, "index_n_heads is \"4\" in config.json, but it is a string; vLLM reads an integer"),
    ("fp4", {"sliding_window": 16.5}, "it is a float; vLLM reads an integer"),
    ("fp4", {"hc_sinkhorn_iters": True}, "it is a boolean; vLLM reads an integer"),
    ("fp4", {"num_hidden_layers": 2**40}, "beyond any DeepSeek model"),
    ("fp4", {"rope_theta": 10**400}, "it is an integer too large for a float; vLLM reads a number"),  # OverflowError
    ("fp4", {"quantization_config": None}, "quantization_config is null"),
    ("vl-fp4", {"vision_dim": 66}, "it must divide into vision_n_heads 4"),
    ("dspark-fp4", {"dspark_block_size": None}, "dspark_block_size is null in config.json"),
    ("dspark-fp4", {"enable_confidence_head": 0}, "it is an integer; vLLM reads a boolean"),
]  # fmt: skip


@pytest.mark.parametrize(("variant", "edits", "says"), REFUSED, ids=[f"{v}-{next(iter(e))}" for v, e, _ in REFUSED])
def test_a_key_out_of_range_or_of_the_wrong_type_is_refused_in_one_line(
    fixture_copy, capsys, tmp_path, variant, edits, says
) -> None:
    src = _edited(fixture_copy, variant, **edits)
    for line in _refused(capsys, src, tmp_path):
        assert says in line, line


def test_every_fixture_config_passes_every_rule() -> None:
    for name, variant in VARIANTS.items():
        if variant.broken is None:
            V4Config.from_dict(make_config(variant), where=name)


def test_the_rules_name_a_vllm_file_and_a_rule_each() -> None:
    for rule in RULES:
        assert "vllm" in rule.source or "transformers" in rule.source, rule.key
        assert rule.rule and rule.applies <= {"text", "vision", "v41", "mtp", "dspark", "dspark-v41"}, rule.key


def test_v41_class_and_draft_are_told_from_the_flat_config() -> None:
    from ckpt_tool.checkpoint.config import flatten_v41

    assert classes_of(flatten_v41(make_config(VARIANTS["v41"]), "c")) == {"v41", "dspark-v41"}
    assert classes_of(make_config(VARIANTS["dspark-fp4"])) == {"text", "dspark"}
    assert classes_of(make_config(VARIANTS["vl-fp4"])) == {"vision", "mtp"}


def test_null_stands_for_absent_only_where_vllm_reads_it_so(fixture_dir) -> None:
    raw = make_config(VARIANTS["dspark-fp4"])
    V4Config.from_dict({**raw, "n_mtp_layers": None})  # nvidia/dspark.py: `n_mtp_layers or 3`
    with pytest.raises(CheckpointError, match="dspark_markov_rank is null"):
        V4Config.from_dict({**raw, "dspark_markov_rank": None})
    check_values(raw)  # the fixture's values as they are


# --- verify: a source config.json changed since conversion --------------------------------------------------------


def test_verify_names_the_keys_of_a_source_config_changed_since_conversion(fixture_copy, capsys, tmp_path) -> None:
    src = fixture_copy("dspark-fp4")
    out = tmp_path / "out"
    assert run_cli(capsys, "convert", src, out, "--tp", "1")[0] == 0
    doc = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**doc, "sliding_window": 32}))
    code, stdout, _ = run_cli(capsys, "verify", out, "--source", src, "--level", "structure", "--json")
    failed = json.loads(stdout)["failures"]
    assert code == 1 and [f["name"] for f in failed] == ["source-fingerprint"], failed
    assert "(changed: sliding_window 16 -> 32)" in failed[0]["message"], failed

    # an edit the tool refuses: the source check fails, naming what changed and why it is refused
    (src / "config.json").write_text(json.dumps({**doc, "dspark_target_layer_ids": [0, 1, 7]}))
    code, stdout, _ = run_cli(capsys, "verify", out, "--source", src, "--level", "structure", "--json")
    failed = json.loads(stdout)["failures"]
    assert code == 1 and [f["name"] for f in failed] == ["source"], failed
    message = failed[0]["message"]
    assert "changed since OUT was converted (changed: dspark_target_layer_ids [0, 1, 2] -> [0, 1, 7])" in message
    assert "layer 7 is not among the model's layers 0-2" in message


# --- the serve line ---------------------------------------------------------------------------------------------


def test_inspect_and_convert_give_num_speculative_tokens_and_where_it_comes_from(fixture_dir, capsys, tmp_path) -> None:
    spec = f'"method": "dspark", "model": "OUT/dspark", "num_speculative_tokens": {DSPARK_BLOCK_SIZE}'
    code, out, _ = run_cli(capsys, "inspect", fixture_dir("dspark-fp4"))
    assert code == 0 and spec in out and "vLLM's default" not in out
    assert f"num_speculative_tokens {DSPARK_BLOCK_SIZE}: config.json's dspark_block_size" in out
    assert "vLLM 0.33.0 and 0.34.0 take the same number when none is given" in out

    o = tmp_path / "out"
    code, text, _ = run_cli(capsys, "convert", fixture_dir("dspark-fp4"), o, "--tp", "1")
    assert code == 0
    assert (
        f"serve: vllm serve {o}/model --load-format sharded_state --tensor-parallel-size 1 --speculative-config "
        f'\'{{"method": "dspark", "model": "{o}/dspark", "num_speculative_tokens": {DSPARK_BLOCK_SIZE}}}\''
    ) in text


def test_a_block_size_in_v41_text_config_is_the_number_served(fixture_copy, capsys) -> None:
    src = _edited(fixture_copy, "v41", block_size=7)  # deepseek_v41.py copies text_config up: vLLM reads 7
    code, out, _ = run_cli(capsys, "inspect", src)
    assert code == 0 and '"num_speculative_tokens": 7}' in out and "config.json's block_size" in out


def test_a_draft_converted_alone_has_no_serve_line(fixture_dir, capsys, tmp_path) -> None:
    code, text, _ = run_cli(capsys, "convert", fixture_dir("fp4"), tmp_path / "out", "--only", "mtp", "--json")
    assert code == 0 and json.loads(text)["serve"] is None
