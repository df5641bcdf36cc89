"""Stage 3, write: the OUT format (``layout``), the conversion driver (``convert``: atomic, resumable, scale-out),
the streaming writer, ``twins`` (tensors a streamed conversion copies from a file it has just written, not the
source), and ``unconvert`` (OUT back to the original checkpoint)."""
