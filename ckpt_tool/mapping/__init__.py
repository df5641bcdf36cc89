"""Stage 2, map: the declarative name mapping (the base rule table ``rules``, element conversions ``conversions``),
one profile module per engine release (``profiles/``), the engine's parameter table, ``--target auto``, and the
planner. ``planner.plan_conversion`` turns headers into a ``plan.Plan`` (pure: headers in, files and byte segments
out; nothing is read or written) with ``grouping`` (sources bound to rule instances), ``splits`` (what a TP split
requires), ``rank_segments`` (each rank's segments), ``aliases`` (names a draft reads that the checkpoint lacks) and
``packing`` (output files); ``hub_needs`` answers what a hub conversion must fetch."""
