"""The command line: the console script (``entry``, with inspect's typer-free path), the typer app (``app``), what
both share (``common``), rendering for people (``render``, rich) and the JSON documents (``jsondoc``)."""
