"""The model class: which of vLLM's DeepSeek V4 models a checkpoint is, as data beside the release profile.

A release profile (``vllm_0_33_plus`` ...) says how one vLLM release lays the text model out; a model class says
what a model built around it changes, the same for every release that serves it. So the text and the vision
model share one copy of each release's tables:

- ``text``: ``DeepseekV4ForCausalLM`` (vllm/models/deepseek_v4/nvidia/model.py), the tables as they are.
- ``vision``: ``DeepseekV4ForConditionalGeneration`` (vllm/models/deepseek_v4/common/vl_model.py, vLLM 0.33.0 and
  0.34.0), chosen by vLLM when config.json has ``vision_n_layers > 0``
  (vllm/transformers_utils/model_arch_config_convertor.py, DeepseekV4ModelArchConfigConvertor). It wraps the text
  model under ``language_model.`` (``init_vllm_registered_model(..., prefix="language_model")``), adds
  ``bias_vl`` to every router (and ``e_score_correction_bias`` to hash layers, vllm/models/deepseek_v4/nvidia/
  model.py), and holds the vision tower, the aligner and the ``image_*`` embeddings unprefixed
  (common/vision.py).

Both serve the same speculative draft, ``DeepSeekV4MTP`` (vllm/config/speculative.py turns any ``deepseek_v4``
config into ``DeepSeekV4MTPModel``), unprefixed; built from the vision config its block has ``bias_vl`` too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ckpt_tool.checkpoint.engram import engram_split
from ckpt_tool.checkpoint.expert_format import describe_experts
from ckpt_tool.mapping.profiles.draft_kind import draft_kind_of
from ckpt_tool.mapping.rules import Rule, vision_block_rules, vision_tower_rules
from ckpt_tool.mapping.rules_v41 import v41_rules


def _none() -> list[Rule]:
    return []


@dataclass(frozen=True)
class ModelClass:
    """What one vLLM model class adds to a release profile's layout."""

    name: str  # text | vision
    architecture: str  # the class vLLM's registry resolves for the target model
    draft: str  # the class of the classic MTP draft (a DSpark checkpoint's: draft_kind.DSPARK)
    target_prefix: str  # prefix of every target-model key the text tables name
    block_rules: Callable[[], list[Rule]] = _none  # rules in the text model's names (prefixed and renamed)
    extra_rules: Callable[[], list[Rule]] = _none  # rules in the engine's own names (neither)
    description: str = ""
    # the whole base table, in place of the profile's (a model whose layers differ, as V4.1's): by expert_dtype
    base_rules: Callable[[str], list[Rule]] | None = None

    def describe(self, config) -> dict:
        """What vLLM builds for ``config`` (a V4Config): this class, its draft (the class, and ``draft_kind``: which
        draft, its layers and how to serve it), and the vision tower's size."""
        kind = draft_kind_of(config)
        doc: dict = {
            "class": self.name,
            "architecture": self.architecture,
            "draft": kind.vllm_class.rsplit(":", 1)[-1] if config.draft_layers else None,
            "draft_kind": kind.describe(config) if config.draft_layers else None,
            "target_prefix": self.target_prefix,
            "description": self.description,
            "experts": describe_experts(config),
        }
        if self.name == "v41":
            doc["engram"] = _engram_doc(config)
        if self.name in ("vision", "v41"):
            doc["vision"] = {
                "layers": config.vision_n_layers,
                "dim": config.vision_dim,
                "heads": config.vision_n_heads,
                "inter_dim": config.vision_inter_dim,
                "patch_size": config.vision_patch_size,
                "downsample_ratio": config.vision_downsample_ratio,
            }
        return doc


def _engram_doc(config) -> dict | None:
    """V4.1's Engram tables: layers, rows and bytes (FP8 rows + one E8M0 byte per 32 columns), how vLLM splits
    them (by hash head) and the tp values it accepts (ckpt_tool.checkpoint.engram)."""
    layout = engram_split(config)
    if layout is None:
        return None
    row_bytes = config.engram_head_dim + config.engram_head_dim // 32
    return {
        "layers": list(layout.layer_ids),
        "rows": list(layout.num_embeddings),
        "bytes": [rows * row_bytes for rows in layout.num_embeddings],
        "hash_heads": layout.hash_heads,
        "accepted_tp": layout.accepted_tps(64),
        "rows_per_rank": {
            tp: {layer: [hi - lo for lo, hi in layout.rank_rows(layer, tp)] for layer in layout.layer_ids}
            for tp in (2, 4, 8)
            if layout.accepts(tp)
        },
    }


TEXT = ModelClass(
    "text",
    "DeepseekV4ForCausalLM",
    "DeepSeekV4MTP",
    "",
    description="DeepSeek V4 (text)",
)
VISION = ModelClass(
    "vision",
    "DeepseekV4ForConditionalGeneration",
    "DeepSeekV4MTP",
    "language_model.",
    block_rules=vision_block_rules,
    extra_rules=vision_tower_rules,
    description="DeepSeek V4 vision (vision tower, aligner, image embeddings; the text model as language_model)",
)
V41 = ModelClass(
    "v41",
    "DeepseekV41ForCausalLM",
    "DSparkDeepseekV4ForCausalLM",
    "",  # the V4.1 table names language_model.* itself
    base_rules=v41_rules,
    description="DeepSeek V4.1 (Engram tables, MXFP8 linears, vision tower; the text model as language_model)",
)
MODEL_CLASSES: dict[str, ModelClass] = {c.name: c for c in (TEXT, VISION, V41)}


def model_class_of(config) -> ModelClass:
    """The model class vLLM builds for ``config`` (a V4Config): V4.1 for ``model_type: deepseek_v41`` (vLLM's registry
    maps its ``DeepseekV41ForCausalLM`` to vllm/models/deepseek_v41/nvidia/vl_model.py), else vision when
    ``vision_n_layers > 0``, else text."""
    if getattr(config, "is_v41", False):
        return V41
    return VISION if getattr(config, "is_vision", False) else TEXT
