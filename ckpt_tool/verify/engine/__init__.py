"""``verify --engine``: OUT judged by the installed vLLM's own model classes and loader rules, without a GPU.

* ``check``: the command's side (manifest, the rank files, one check per component and rank);
* ``judge``: the rules of vLLM's ``ShardedStateLoader``, as pure functions;
* ``probe`` and ``vllm_stubs``: standalone files run by the serving environment's interpreter (they import no
  ckpt_tool; ``tests/engine`` builds vLLM's classes with the same ``vllm_stubs``).
"""

from __future__ import annotations

from ckpt_tool.verify.engine.check import EngineError, check_with_vllm

__all__ = ["EngineError", "check_with_vllm"]
