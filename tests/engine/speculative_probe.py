"""Feed ``--speculative-config`` JSON to one vLLM release's own engine config, as ``vllm serve`` does.

    python tests/engine/speculative_probe.py --site .engine-site/vllm-0.34.0 JOBS.json

JOBS.json: ``{"jobs": [{"model": OUT/model, "speculative": {...}}, ...]}``. For each job, vLLM's ``EngineArgs``
(model, ``--load-format sharded_state``, ``--tensor-parallel-size 1``, the speculative config as given) builds its
``VllmConfig`` (``create_engine_config``: the release's own ``SpeculativeConfig`` validates and completes the
speculative config), with what ``ckpt_tool.verify.engine.vllm_stubs`` stubs for a machine without a GPU. stdout: one
JSON document ``{"vllm_version", "results": [{"method", "num_speculative_tokens", "draft_architectures"} or
{"error"}]}``; vLLM's logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ckpt_tool.verify.engine import vllm_stubs as stubs


def engine_config(model: str, speculative: dict):
    """vLLM's engine config for ``vllm serve MODEL --load-format sharded_state --speculative-config SPEC``."""
    from vllm.engine.arg_utils import EngineArgs  # after bootstrap()

    kwargs = dict(
        model=model,
        tokenizer=model,
        skip_tokenizer_init=True,
        tensor_parallel_size=1,
        load_format="sharded_state",
        max_model_len=1024,
        speculative_config=speculative,
    )
    if stubs.text_config(model).get("engram_layer_ids"):
        kwargs["engram_config"] = {"cpu_offload": False}  # pinned host memory needs a GPU (see vllm_stubs)
    with stubs.gpu_model_runner():
        return EngineArgs(**kwargs).create_engine_config()


def run(job: dict) -> dict:
    try:
        spec = engine_config(job["model"], job["speculative"]).speculative_config
    except Exception as e:  # noqa: BLE001 - a refusal is the answer
        return {"error": f"{type(e).__name__}: {e}"}
    return {
        "method": spec.method,
        "num_speculative_tokens": spec.num_speculative_tokens,
        "draft_architectures": list(spec.draft_model_config.hf_config.architectures or []),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--site", required=True)
    p.add_argument("jobs")
    args = p.parse_args()
    real_stdout = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM's prints to stderr; stdout keeps the one JSON answer
    stubs.bootstrap(Path(args.site))
    import vllm

    jobs = json.loads(Path(args.jobs).read_text())["jobs"]
    json.dump({"vllm_version": vllm.__version__, "results": [run(j) for j in jobs]}, real_stdout)
    real_stdout.write("\n")
    real_stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # vLLM's exit handlers take seconds and have nothing left to do


if __name__ == "__main__":
    raise SystemExit(main())
