"""The fixture cases every engine test runs for every verified vLLM release."""

# (fixture variant, tp, expert parallel)
CASES = [
    ("fp4", 1, False),
    ("fp4", 2, False),
    ("fp4", 4, False),
    ("fp4", 2, True),
    ("fp4", 4, True),
    ("fp8", 2, False),
    ("fp8-e8m0", 2, False),
    ("fp4-2mtp", 2, False),
    ("fp4-mtp-emb", 1, False),
    # 3-block shared experts, zero-padded by vLLM's own stock load: rank 1 of tp 2 part real part zeros, rank 3
    # of tp 4 zeros only; float32 scales from E8M0 (the pad is 2^-127 there). Expert parallel: with the routed
    # experts split over tp, vLLM's MXFP4 MoE backends round each rank's 192/96 rows up to 128-multiples, a
    # backend-dependent layout ckpt-tool does not write (and fp8 routed experts refuse a non-whole-block split).
    ("fp4-pad", 2, True),
    ("fp4-pad", 4, True),
    ("fp8-e8m0-pad", 2, True),
]
