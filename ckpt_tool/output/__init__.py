"""Stage 3, write: the OUT format (``layout``), the conversion driver (``convert``: atomic, resumable, scale-out),
the streaming writer, and ``unconvert`` (OUT back to the original checkpoint)."""
