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
  Markov and confidence heads) at model level. ``num_speculative_tokens``: when the speculative config gives none,
  vLLM 0.33.0 (config/speculative.py ``SpeculativeConfig.__post_init__``) and 0.34.0
  (v1/worker/gpu/spec_decode/dspark/config.py ``resolve_num_speculative_tokens``) both take config.json's
  ``block_size``, else ``dspark_block_size``; the serve line the tool prints gives that number explicitly all the
  same (the engine tests feed it to each release's own ``SpeculativeConfig``).

vLLM picks the method from the draft folder's path when none is given, and a folder without ``dspark`` in its path
is taken for MTP (0.33.0 ``SpeculativeConfig.__post_init__``; 0.34.0 ``dspark/config.py``): the DSpark folder of
OUT is called ``dspark``, and the serve command names the method anyway.

Where the vLLM series one profile covers build a draft with different parameters, the draft kind says so
(``context_wkv_since``): DeepSeek V4.1's DSpark draft holds ``model.context_wkv_proj`` from 0.34 on and not in 0.33,
and vLLM's sharded loader refuses a missing key and an extra one alike, so its files are written for one series
(``--vllm``; by default the installed vLLM's, else the newest the profile covers) and the manifest records which.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckpt_tool.mapping.profiles.series import series_of
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
    # the first vLLM series whose class holds model.context_wkv_proj (None: no series does): where the series a
    # profile covers fall on both sides of it, the draft's files are written for one series (layout_varies)
    context_wkv_since: str | None = None
    series_note: str = ""  # what inspect says of that difference (empty: none)

    def layers(self, config) -> int:
        """How many draft layers (stages) vLLM builds for ``config`` (a V4Config)."""
        return config.draft_layers

    def speculative_tokens(self, config) -> int:
        """The ``num_speculative_tokens`` the serve command passes: a DSpark draft's block (config.json's
        ``block_size``, else ``dspark_block_size``: what vLLM 0.33.0 and 0.34.0 take when none is given, see
        :func:`tokens_key`), one token for the classic MTP head (its one trained step)."""
        if self.method == "dspark":
            return int(_flat_get(config.raw, "block_size") or config.dspark_block_size or 1)
        return 1

    def tokens_key(self, config) -> str | None:
        """The config.json key :meth:`speculative_tokens` comes from (None: the classic MTP's fixed 1). vLLM 0.33.0
        (config/speculative.py ``SpeculativeConfig.__post_init__``, ``use_dspark()``) and 0.34.0
        (v1/worker/gpu/spec_decode/dspark/config.py ``resolve_num_speculative_tokens``) read ``block_size`` when it
        is not None, else ``dspark_block_size``."""
        if self.method != "dspark":
            return None
        return "block_size" if _flat_get(config.raw, "block_size") is not None else "dspark_block_size"

    def speculative_config(self, config, folder: str) -> str:
        """The ``--speculative-config`` JSON that serves this draft from ``folder``: the method and the number of
        tokens always explicit (vLLM guesses the method from the folder's path otherwise)."""
        return (
            f'{{"method": "{self.method}", "model": "{folder}", '
            f'"num_speculative_tokens": {self.speculative_tokens(config)}}}'
        )

    def serve_command(self, config, out: str, tp: int, ep: bool, draft: bool = True) -> str:
        """The ``vllm serve`` line for OUT (``out``) converted at ``tp`` (``ep``: --moe-parallel ep), with this draft
        when ``draft``: the sharded load format, the same tp, expert parallelism exactly when converted with it."""
        line = f"vllm serve {out}/model --load-format sharded_state --tensor-parallel-size {tp}"
        if ep:
            line += " --enable-expert-parallel"
        if draft:
            line += f" --speculative-config '{self.speculative_config(config, f'{out}/{self.component}')}'"
        return line

    def holds_context_wkv(self, series: str | None) -> bool:
        """Whether vLLM ``series``' class (``"0.34"``; None: the newest) holds ``model.context_wkv_proj``."""
        if self.context_wkv_since is None:
            return False
        return series is None or series_of(series) >= series_of(self.context_wkv_since)

    def layout_varies(self, covers: tuple[str, ...]) -> bool:
        """Whether the series in ``covers`` (a profile's) build this draft with different parameters."""
        return len({self.holds_context_wkv(c) for c in covers}) > 1

    def rules(self, config, series: str | None) -> list[Rule] | None:
        """The draft's rules for vLLM ``series`` in place of the base table's classic MTP rules (None: keep those)."""
        if self.name == "dspark":
            return dspark_rules(config.expert_dtype, config.draft_layers, vision=config.is_vision)
        if self.name == "dspark-v41":
            return v41_dspark_rules(config.draft_layers, context_wkv=self.holds_context_wkv(series))
        return None

    def aliases(self, config, series: str | None) -> dict[str, str]:
        """Alias → source tensor the draft's rules for vLLM ``series`` read under another name (besides the classic
        MTP's optional embedding and head, which the plan materializes only when absent)."""
        if self.method != "dspark":
            return {}
        return dspark_aliases(config.draft_layers, context_wkv=self.holds_context_wkv(series))

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
            "num_speculative_tokens_key": self.tokens_key(config),
            "description": self.description,
            "series_note": self.series_note or None,
        }


def _flat_get(raw: dict, key: str):
    """``key`` of a config.json as vLLM's config object holds it: V4.1's ``text_config`` keys over the top level
    (vllm/transformers_utils/configs/deepseek_v41.py copies them up)."""
    text = raw.get("text_config")
    if isinstance(text, dict) and key in text:
        return text[key]
    return raw.get(key)


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
    context_wkv_since="0.33",  # nvidia/dspark.py in 0.33.0 and 0.34.0: DSparkDeepseekV4Model.context_wkv_proj
)
# V4.1's DSpark draft (vllm/models/deepseek_v41/nvidia/dspark.py, registry DSparkV41DraftModel): vLLM 0.34.0's holds
# model.context_wkv_proj (DSparkDeepseekV4Model.__init__), 0.33.0's computes the context KV from each stage's
# fused_wqa_wkv and has no such parameter; the sharded loader refuses the key one wants and the other lacks.
DSPARK_V41 = DraftKind(
    "dspark-v41",
    "dspark",
    "DSparkV41DraftModel",
    "vllm/models/deepseek_v41/nvidia/dspark.py:DSparkDeepseekV4ForCausalLM",
    "dspark",
    "DSpark stage",
    "DeepSeek V4.1's DSpark draft: decoder-block stages with their own experts, Markov and confidence heads",
    context_wkv_since="0.34",
    series_note="its files differ by vLLM series (0.34 holds model.context_wkv_proj, 0.33 does not): convert writes "
    "them for the installed vLLM's series, or the one --vllm names",
)
DRAFT_KINDS: dict[str, DraftKind] = {k.name: k for k in (MTP, DSPARK, DSPARK_V41)}
DRAFT_COMPONENTS = tuple(dict.fromkeys(k.component for k in DRAFT_KINDS.values()))


def draft_kind_of(config) -> DraftKind:
    """The draft ``config`` (a V4Config) describes: DSpark when config.json names ``dspark_target_layer_ids`` (V4.1's
    own DSpark for a V4.1 config; vLLM 0.33/0.34 refuse a classic MTP draft on V4.1)."""
    if getattr(config, "is_v41", False):
        return DSPARK_V41
    return DSPARK if getattr(config, "is_dspark", False) else MTP
