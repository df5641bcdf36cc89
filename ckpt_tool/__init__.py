"""ckpt-tool: convert, inspect and verify DeepSeek V4 checkpoints for vLLM (the target model and its draft).

One pipeline, a folder a stage, each importing only from the stages before it (``tests/test_stage_order.py``):

- ``checkpoint/``: read a source: headers, config.json, index, hub repo, the one byte reader, completeness;
- ``mapping/``: plan: the rule tables, the engine profiles, the planner (headers in, output files out);
- ``output/``: write: the OUT format, the conversion driver and its streaming writer, unconvert;
- ``verify/``: prove: structure, values, numbers (kernels, reference forward) and the engine's own judgement;
- ``cli/``: the command line: parse, call one library function a command, render.

``processes`` (forking and CPU counts) and ``errors`` serve every stage; ``fixtures/`` generates the checkpoints the
tests, the example and the benches use.
"""

__version__ = "0.1.0"
