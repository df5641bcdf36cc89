"""Stage 1, read: a source checkpoint's safetensors headers (``headers``, parsed strictly by ``strict_json``),
its index (``index``), config.json (``config``) and dtypes (``dtypes``); a hub repo (``hub``, and ``hub_ranges`` for
byte ranges over HTTP); the one reader of tensor bytes (``reader``, kept in step by ``lockstep``) and the identity of
each source file (``identity``); what config.json says the checkpoint must hold (``expected``, ``completeness``,
``agreement``, ``engram``); inspect's summary (``summary``). Never imports torch: this is the header path."""
