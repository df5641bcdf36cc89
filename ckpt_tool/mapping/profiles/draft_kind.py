"""The draft kind: which speculative draft a checkpoint's ``mtp.*`` tensors are, as data beside the model class.

DeepSeek ships two drafts under the same ``mtp.{i}.`` names, and vLLM 0.33.0 / 0.34.0 build a different class for
each; the user picks it with ``--speculative-config '{"method": ...}'``, and the checkpoint's config.json says which
one its weights are:

- ``mtp``: the classic MTP head (V4-Flash, V4-Pro): ``DeepSeekV4MTP`` (vllm/models/deepseek_v4/nvidia/mtp.py,
  registry name ``DeepSeekV4MTPModel``), ``num_nextn_predict_layers`` layers, each with ``enorm``/``hnorm``/
  ``e_proj``/``h_proj``, a decoder block and a shared head, served with ``"method": "mtp"``.
- ``dspark``: the DSpark draft (V4-Flash-0731): ``DSparkDeepseekV4ForCausalLM`` (vllm/models/deepseek_v4/nvidia/
  dspark.py, registry name ``DSparkDraftModel``), chosen by ``"method": "dspark"`` (vllm/config/speculative.py 0.33.0
  ``SpeculativeConfig.__post_init__``; 0.34.0 v1/worker/gpu/spec_decode/dspark/config.py). Its model reads
  ``dspark_target_layer_ids`` and ``dspark_markov_rank`` from config.json without a default (nvidia/dspark.py,
  ``DSparkDeepseekV4Model.__init__``), so a config.json that names target layers is a DSpark checkpoint.
  ``n_mtp_layers`` stages (default 3), the head stack (``main_proj``, ``main_norm``, ``norm``, ``hc_head_*``, the
  Markov and confidence heads) at model level. ``num_speculative_tokens`` defaults to ``dspark_block_size``.

vLLM picks the method from the draft folder's path when none is given, and a folder without ``dspark`` in its path
is taken for MTP (0.33.0 ``SpeculativeConfig.__post_init__``; 0.34.0 ``dspark/config.py``): the DSpark folder of
OUT is called ``dspark``, and the serve command names the method anyway.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckpt_tool.mapping.rules import Rule, dspark_aliases, dspark_rules
from ckpt_tool.mapping.rules_v41 import v41_dspark_rules


@dataclass(frozen=True)
class DraftKind:
    """One speculative draft vLLM builds from a checkpoint's ``mtp.*`` tensors."""

    name: str  # mtp | dspark
    component: str  # the folder of OUT it is written to (and Rule.component)
    architecture: str  # vLLM's registry name for the class
    vllm_class: str  # the class, by its module in vLLM
    method: str  # "method" of --speculative-config
    layer_word: str  # what one mtp.{i} is called in messages
    description: str
    not_written: str = ""  # why no profile writes this draft yet (empty: profiles that list it do)

    def layers(self, config) -> int:
        """How many draft layers (stages) vLLM builds for ``config`` (a V4Config)."""
        return config.draft_layers

    def speculative_tokens(self, config) -> int:
        """vLLM's default ``num_speculative_tokens`` for this draft (what the serve command passes)."""
        if self.method == "dspark":
            # dspark/config.py (0.34) / SpeculativeConfig (0.33): a top-level block_size wins, else dspark_block_size
            return int(config.raw.get("block_size") or config.dspark_block_size or 1)
        return 1

    def speculative_config(self, config, folder: str) -> str:
        """The ``--speculative-config`` JSON that serves this draft from ``folder``."""
        return (
            f'{{"method": "{self.method}", "model": "{folder}", '
            f'"num_speculative_tokens": {self.speculative_tokens(config)}}}'
        )

    def rules(self, config) -> list[Rule] | None:
        """The draft's rules in place of the base table's classic MTP rules (None: keep those)."""
        if self.name == "dspark":
            return dspark_rules(config.expert_dtype, config.draft_layers, vision=config.is_vision)
        if self.name == "dspark-v41":
            return v41_dspark_rules(config.draft_layers)
        return None

    def aliases(self, config) -> dict[str, str]:
        """Alias → source tensor the draft's rules read under another name (besides the classic MTP's optional
        embedding and head, which the plan materializes only when absent)."""
        return dspark_aliases(config.draft_layers) if self.name == "dspark" else {}

    def describe(self, config) -> dict:
        """What ``inspect`` says of this draft for ``config``: its class, stages and how to serve it."""
        return {
            "kind": self.name,
            "architecture": self.architecture,
            "class": self.vllm_class,
            "method": self.method,
            "layers": self.layers(config),
            "folder": self.component,
            "num_speculative_tokens": self.speculative_tokens(config),
            "description": self.description,
            "not_written": self.not_written or None,
        }


MTP = DraftKind(
    "mtp",
    "mtp",
    "DeepSeekV4MTPModel",
    "vllm/models/deepseek_v4/nvidia/mtp.py:DeepSeekV4MTP",
    "mtp",
    "MTP layer",
    "classic MTP head (enorm, hnorm, e_proj, h_proj, a decoder block, shared head) per layer",
)
DSPARK = DraftKind(
    "dspark",
    "dspark",
    "DSparkDraftModel",
    "vllm/models/deepseek_v4/nvidia/dspark.py:DSparkDeepseekV4ForCausalLM",
    "dspark",
    "DSpark stage",
    "DSpark draft: decoder-block stages, main_proj over the target's hidden states, Markov and confidence heads",
)
# V4.1's DSpark draft (vllm/models/deepseek_v41/nvidia/dspark.py, registry DSparkV41DraftModel): vLLM 0.34.0's holds
# model.context_wkv_proj, 0.33.0's does not (its sharded loader refuses the key the other wants), so one profile
# covering both releases cannot write it: no profile lists it among its drafts yet, and convert says so.
DSPARK_V41 = DraftKind(
    "dspark-v41",
    "dspark",
    "DSparkV41DraftModel",
    "vllm/models/deepseek_v41/nvidia/dspark.py:DSparkDeepseekV4ForCausalLM",
    "dspark",
    "DSpark stage",
    "DeepSeek V4.1's DSpark draft: decoder-block stages with their own experts, Markov and confidence heads",
    not_written="vLLM 0.34.0's V4.1 DSpark draft holds model.context_wkv_proj and 0.33.0's does not "
    "(vllm/models/deepseek_v41/nvidia/dspark.py), so one file set cannot serve both releases; ckpt-tool does not "
    "write this draft yet",
)
DRAFT_KINDS: dict[str, DraftKind] = {k.name: k for k in (MTP, DSPARK, DSPARK_V41)}
DRAFT_COMPONENTS = tuple(dict.fromkeys(k.component for k in DRAFT_KINDS.values()))


def draft_kind_of(config) -> DraftKind:
    """The draft ``config`` (a V4Config) describes: DSpark when config.json names ``dspark_target_layer_ids`` (V4.1's
    own DSpark for a V4.1 config; vLLM 0.33/0.34 refuse a classic MTP draft on V4.1)."""
    if getattr(config, "is_v41", False):
        return DSPARK_V41
    return DSPARK if getattr(config, "is_dspark", False) else MTP
