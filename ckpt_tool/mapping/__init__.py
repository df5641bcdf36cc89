"""Stage 2, map: the declarative name mapping (the base rule table, element conversions), one profile module per
engine layout (``profiles/``), the engine's parameter table, ``--target auto``, and the planner that turns headers
into the output layout (pure: headers in, files and byte segments out; nothing is read or written)."""
