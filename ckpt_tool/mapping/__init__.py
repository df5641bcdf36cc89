"""Stage 2, map: the declarative name mapping (the base rule table ``rules``, V4.1's ``rules_v41``, element
conversions ``conversions``), one profile module per engine release series (``profiles/``, with the model classes and
draft kinds), the engine's parameter table (``engine_table``), ``--target auto`` (``target``) and the planner.
``planner.plan_conversion`` turns headers into a ``plan.Plan`` (pure: headers in, files and byte segments out;
nothing is read or written) with ``grouping`` (sources bound to rule instances), ``splits`` (what a TP split
requires), ``rank_segments`` (each rank's segments), ``aliases`` (names a draft reads that the checkpoint lacks) and
``packing`` (output files); ``selection.plan_run`` plans and keeps the files a run writes (``--ranks``, scale-out),
for convert, verify, unconvert and the dry run alike; ``request`` turns a convert command line into one;
``hub_needs`` answers what a hub conversion must fetch; ``inspection`` and ``environment`` are inspect's and env's
library calls."""
