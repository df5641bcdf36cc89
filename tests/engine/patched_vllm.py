"""A "fork with one patched model file", for the engine tests: vLLM's ``DeepSeekV4MTP`` changed, then the probe run.

    PATCH=extra-param|raise python tests/engine/patched_vllm.py PROBE < request.json   # as --engine-python does

``extra-param``: the MTP class holds one more parameter (``patched_scale``), as a fork's model file might;
``raise``: building the MTP class raises, as a fork needing something a CPU machine lacks might.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import runpy
import sys

TARGET = "vllm.models.deepseek_v4.nvidia.mtp"


def patch(module) -> None:
    import torch

    cls = module.DeepSeekV4MTP
    original = cls.__init__
    mode = os.environ["PATCH"]

    @functools.wraps(original)  # vLLM reads the signature (vllm_config, prefix) to call it
    def __init__(self, *args, **kwargs):
        if mode == "raise":
            raise RuntimeError("patched DeepSeekV4MTP: needs a GPU to build")
        original(self, *args, **kwargs)
        self.register_parameter("patched_scale", torch.nn.Parameter(torch.empty(8)))

    cls.__init__ = __init__


class PatchAfterImport(importlib.abc.MetaPathFinder):
    """Lets vLLM's own module load, then patches it (the file on disk stays vLLM's)."""

    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


def main() -> None:
    sys.path.pop(0)  # tests/engine must not shadow anything vLLM imports
    sys.meta_path.insert(0, PatchAfterImport())
    probe = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(probe, run_name="__main__")


if __name__ == "__main__":
    main()
