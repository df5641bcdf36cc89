"""Stage 4, prove: ``levels`` runs the levels on OUT against its source (``source_match``): ``structure``,
``values`` and the numeric level (``numeric``, in one pass with values: ``one_pass``), and records them in
``verdict``; ``rows`` reads OUT and source rows for them. The numeric level checks every converted tensor
(``linear_check``: units from ``tensor_units``, counted in ``coverage``) through the GEMMs (``kernels/``; the
dequantization spec ``quant``, tiled in ``tiled_matmul``) on threads and forked workers (``compute_pool``), and runs
the MTP reference forward (``mtp_forward``, ``reference``, ``weight_sides``, ``expert_probes``, ``forward_names``).
``engine``: the installed vLLM judges OUT in a subprocess."""
