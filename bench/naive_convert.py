"""The naive way to convert a V4 checkpoint's MTP layer, as a baseline for bench/convert_bench.py.

    python bench/naive_convert.py SRC OUT

What a short script written against safetensors' own API does: ``safetensors.torch.load_file`` every
shard into one state dict, apply the ``vllm-seed`` mapping of the MTP layer in memory (rename, fuse
wq_a|wkv and w1|w3 with ``torch.cat``, stack routed experts with ``torch.stack``, I8/E8M0 → uint8,
materialize the MTP embedding/head from ``embed.weight``/``head.weight``; tp 1), then ``save_file``
one output file and fsync it (ckpt-tool fsyncs too). Same tensors, names and bytes as
``ckpt-tool convert SRC OUT --only mtp --tp 1`` (in one file instead of <= 5 GiB parts); memory is the
whole checkpoint plus the stacked experts.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def convert(src: Path, out: Path) -> int:
    cfg = json.loads((src / "config.json").read_text())
    index = json.loads((src / "model.safetensors.index.json").read_text())
    fp4 = cfg.get("expert_dtype", "fp4") == "fp4"
    sd: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        sd.update(load_file(src / shard))
    N, E = cfg["num_hidden_layers"], cfg["n_routed_experts"]
    res: dict[str, torch.Tensor] = {}
    for i in range(cfg["num_nextn_predict_layers"]):
        p, S = f"mtp.{i}.", f"model.layers.{N + i}."
        B = S + "mtp_block."
        if i == 0:
            res["model.embed_tokens.weight"] = sd.get(p + "emb.tok_emb.weight", sd["embed.weight"])
        res[S + "shared_head.head.weight"] = sd.get(p + "head.weight", sd["head.weight"])
        res[S + "shared_head.norm.weight"] = sd[p + "norm.weight"]
        for k in (
            "enorm.weight",
            "hnorm.weight",
            "e_proj.weight",
            "h_proj.weight",
            "hc_head_fn",
            "hc_head_base",
            "hc_head_scale",
        ):
            res[S + k] = sd[p + k]
        for k in ("e_proj", "h_proj"):
            res[S + k + ".weight_scale_inv"] = sd[p + k + ".scale"]
        a = p + "attn."
        res[B + "attn.fused_wqa_wkv.weight"] = torch.cat([sd[a + "wq_a.weight"], sd[a + "wkv.weight"]])
        res[B + "attn.fused_wqa_wkv.weight_scale_inv"] = torch.cat([sd[a + "wq_a.scale"], sd[a + "wkv.scale"]])
        f = p + "ffn."
        res[B + "ffn.shared_experts.gate_up_proj.weight"] = torch.cat(
            [sd[f + "shared_experts.w1.weight"], sd[f + "shared_experts.w3.weight"]]
        )
        res[B + "ffn.shared_experts.gate_up_proj.weight_scale_inv"] = torch.cat(
            [sd[f + "shared_experts.w1.scale"], sd[f + "shared_experts.w3.scale"]]
        )
        res[B + "ffn.shared_experts.down_proj.weight"] = sd[f + "shared_experts.w2.weight"]
        res[B + "ffn.shared_experts.down_proj.weight_scale_inv"] = sd[f + "shared_experts.w2.scale"]
        res[B + "ffn.gate.weight"] = sd[f + "gate.weight"]
        if f + "gate.bias" in sd:
            res[B + "ffn.gate.e_score_correction_bias"] = sd[f + "gate.bias"]
        if f + "gate.tid2eid" in sd:
            res[B + "ffn.gate.tid2eid"] = sd[f + "gate.tid2eid"]
        esc = "weight_scale" if fp4 else "weight_scale_inv"
        u8 = (lambda t: t.view(torch.uint8)) if fp4 else (lambda t: t)
        for kind, suffix in (("weight", "weight"), ("scale", esc)):
            w13 = [
                torch.cat([u8(sd[f"{f}experts.{j}.w1.{kind}"]), u8(sd[f"{f}experts.{j}.w3.{kind}"])]) for j in range(E)
            ]
            res[f"{B}ffn.experts.w13_{suffix}"] = torch.stack(w13)
            del w13
            res[f"{B}ffn.experts.w2_{suffix}"] = torch.stack([u8(sd[f"{f}experts.{j}.w2.{kind}"]) for j in range(E)])
        for name, t in sd.items():  # everything else of the block: a rename under .mtp_block.
            if not name.startswith(p):
                continue
            rest = name[len(p) :]
            if re.match(r"(attn_norm|ffn_norm)\.weight$|hc_(attn|ffn)_(fn|base|scale)$", rest) or (
                rest.startswith("attn.") and not re.match(r"attn\.(wq_a|wkv)\.", rest)
            ):
                key = B + rest
                if key.endswith(".scale"):
                    key = key[: -len(".scale")] + ".weight_scale_inv"
                res[key] = t
    out.mkdir(parents=True, exist_ok=True)
    dest = out / "model.safetensors"
    save_file({k: v.contiguous() for k, v in res.items()}, dest, metadata={"format": "pt"})
    fd = os.open(dest, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return dest.stat().st_size


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    size = convert(Path(args[0]), Path(args[1]))
    print(json.dumps({"bytes": size, "seconds": round(time.perf_counter() - t0, 3)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
