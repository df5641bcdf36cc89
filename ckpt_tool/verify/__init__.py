"""Stage 4, prove: the levels (``levels`` runs them: ``source_match``, ``structure``, ``values``, numeric), their
shared record (``verdict``), the per-tensor numeric check and the MTP reference forward, the dequantization spec
(``quant``) and its GEMM kernels, and the engine check (``engine``: the installed vLLM judges OUT in a subprocess)."""
