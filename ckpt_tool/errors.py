"""Error types. Anything caused by user data raises one of these; the CLI turns them into one line."""

from __future__ import annotations


class CkptToolError(Exception):
    """Base class: a problem with the user's input or environment, reported without a traceback."""

    exit_code = 1


class CheckpointError(CkptToolError):
    """The checkpoint (config, index, shard header or tensor bytes) is invalid."""


class HeaderError(CheckpointError):
    """A safetensors file's header or layout violates the format."""

    def __init__(self, file: str, message: str, tensor: str | None = None) -> None:
        self.file = file
        self.tensor = tensor
        where = f"{file}: tensor {tensor!r}: " if tensor else f"{file}: "
        super().__init__(where + message)


class PlanError(CkptToolError):
    """The conversion cannot be planned (unknown names, missing MTP layers, bad TP degree, ...)."""


class OutputError(CkptToolError):
    """The output folder cannot be written (exists and is complete, locked, unwritable, disk full)."""


class UsageError(CkptToolError):
    """Bad command-line usage."""

    exit_code = 2


MTP_MISSING_MESSAGE = (
    "MTP speculative decoding layer {layer} weights missing from checkpoint. "
    "The checkpoint may have been quantized without including the MTP layers. "
    "Use a checkpoint that includes MTP layer weights, or disable speculative decoding."
)

# An absent DSpark stage: vLLM's DSpark loader (vllm/models/deepseek_v4/nvidia/dspark.py) has no check of its own and
# would leave the stage's parameters uninitialised.
DSPARK_STAGE_MISSING_MESSAGE = (
    "DSpark stage mtp.{stage} has no tensor in the checkpoint, but config.json gives {stages} stages (n_mtp_layers, "
    "default 3); vLLM would build it and leave it uninitialised: the checkpoint is incomplete, download the missing "
    "files again, or convert the target alone with --only model"
)
