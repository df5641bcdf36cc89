"""Stage 1, read: a source checkpoint's safetensors headers, config.json, index and hub repo; what its config
says it must hold (completeness, shapes); inspect's summary. Never imports torch: this is the header path."""
