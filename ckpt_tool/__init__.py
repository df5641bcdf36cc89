"""ckpt-tool: convert, inspect and verify DeepSeek V4 checkpoints for vLLM (target model + MTP draft)."""

__version__ = "0.1.0"
