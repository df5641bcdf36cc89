"""The DeepSeek V4 model config, as read from a checkpoint's ``config.json``.

Only the keys the converter and the reference forward need are typed here; the whole JSON
document is kept in ``raw`` so it can be copied to the output unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ckpt_tool.checkpoint.config_keys import check_types, check_values
from ckpt_tool.checkpoint.expert_format import MoeQuant, moe_quant_of
from ckpt_tool.checkpoint.strict_json import json_problem
from ckpt_tool.errors import CheckpointError

# Keys every V4 config must carry (the released deepseek-ai/DeepSeek-V4-Flash and -Pro config.json; DeepSeek-V4's
# inference/model.py ModelArgs) and their Python types.
REQUIRED_KEYS: dict[str, type | tuple[type, ...]] = {
    "vocab_size": int,
    "hidden_size": int,
    "num_hidden_layers": int,
    "num_nextn_predict_layers": int,
    "num_attention_heads": int,
    "head_dim": int,
    "qk_rope_head_dim": int,
    "q_lora_rank": int,
    "o_groups": int,
    "o_lora_rank": int,
    "n_routed_experts": int,
    "n_shared_experts": int,
    "num_experts_per_tok": int,
    "moe_intermediate_size": int,
    "num_hash_layers": int,
    "compress_ratios": list,
    "hc_mult": int,
    "rms_norm_eps": (int, float),
}

# The vision variant (DeepSeek-V4-Flash-Vision): vLLM builds DeepseekV4ForConditionalGeneration when
# ``vision_n_layers > 0`` (vllm/transformers_utils/model_arch_config_convertor.py, DeepseekV4ModelArchConfigConvertor,
# vLLM 0.33.0 / 0.34.0) and reads these keys without a default (vllm/models/deepseek_v4/common/vision.py): they
# size the tower, so every one must be there. vision_rope_theta and the vision_max_* / min_pixels keys only
# matter at run time (convert copies config.json as it is).
VISION_KEYS = (
    "vision_dim",
    "vision_n_heads",
    "vision_inter_dim",
    "vision_patch_size",
    "vision_downsample_ratio",
)


# DeepSeek V4.1: vLLM 0.33.0 / 0.34.0's own config class (vllm/transformers_utils/configs/deepseek_v41.py,
# DeepseekV41Config) copies every key of the nested text_config to the top level, maps vision_config to vision_*
# attributes (with its defaults) and takes expert_dtype from quantization_config when absent. V4.1 has no hash layers
# (vllm/models/deepseek_v41/nvidia/model.py: num_hash_layers 0).
V41_MODEL_TYPE = "deepseek_v41"
V41_VISION_KEYS = {  # vision_config key -> (our attribute, vLLM's default)
    "num_hidden_layers": ("vision_n_layers", 0),
    "hidden_size": ("vision_dim", 1024),
    "num_attention_heads": ("vision_n_heads", 16),
    "intermediate_size": ("vision_inter_dim", 2816),
    "patch_size": ("vision_patch_size", 14),
    "downsample_ratio": ("vision_downsample_ratio", 3),
}


def flatten_v41(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """A V4.1 config.json flattened as vLLM's DeepseekV41Config flattens it (the nested document stays ``raw``)."""
    text, vision = raw.get("text_config") or {}, raw.get("vision_config") or {}
    if not isinstance(text, dict) or not isinstance(vision, dict):
        raise CheckpointError(
            f"{where}: model_type {V41_MODEL_TYPE} needs text_config and vision_config objects; use the model's "
            "released config.json"
        )
    flat = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
    flat.update((k, v) for k, v in text.items() if k != "model_type")
    flat["model_type"] = V41_MODEL_TYPE
    for key, (attr, default) in V41_VISION_KEYS.items():
        flat[attr] = vision.get(key, default)
    quant = flat.get("quantization_config") or {}
    if "expert_dtype" not in flat and isinstance(quant, dict) and "expert_dtype" in quant:
        flat["expert_dtype"] = quant["expert_dtype"]
    flat.setdefault("num_hash_layers", 0)
    return flat


def _v41_fields(raw: dict[str, Any]) -> dict[str, Any]:
    if raw.get("model_type") != V41_MODEL_TYPE:
        return {}
    ints = lambda key: tuple(int(x) for x in raw.get(key) or ())  # noqa: E731
    return {
        "model_type": V41_MODEL_TYPE,
        "kv_source_layer_ids": ints("kv_source_layer_ids"),
        "index_source_layer_ids": ints("index_source_layer_ids"),
        "engram_layer_ids": ints("engram_layer_ids"),
        "engram_num_embeddings": ints("engram_num_embeddings"),
        "engram_max_ngram_size": int(raw.get("engram_max_ngram_size") or 0),
        "engram_n_heads": int(raw.get("engram_n_heads") or 0),
        "engram_head_dim": int(raw.get("engram_head_dim") or 0),
        "engram_vocab_size": int(raw.get("engram_vocab_size") or 0),
        "engram_compressed_vocab_size": int(raw.get("engram_compressed_vocab_size") or 0),
        # the draft stages' experts: nvidia/model.py (0.33 :140-146 / 0.34 :142-148) falls back to the main layers'
        "dspark_n_routed_experts": raw.get("dspark_n_routed_experts") or raw["n_routed_experts"],
        "dspark_num_experts_per_tok": raw.get("dspark_num_experts_per_tok") or raw["num_experts_per_tok"],
    }


# The DSpark draft (DeepSeek-V4-Flash-0731: the stages mtp.0-2). vLLM 0.33.0 / 0.34.0's DSparkDeepseekV4Model
# (vllm/models/deepseek_v4/nvidia/dspark.py) reads dspark_target_layer_ids and dspark_markov_rank without a default:
# a config.json naming target layers is a DSpark checkpoint, and must give the Markov rank too.
DSPARK_KEY = "dspark_target_layer_ids"
DSPARK_DEFAULT_STAGES = 3  # nvidia/dspark.py: `getattr(config, "n_mtp_layers", None) or 3` (V4 ignores nextn)


@dataclass(frozen=True)
class V4Config:
    """Typed view of a DeepSeek V4 ``config.json``."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_nextn_predict_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    num_hash_layers: int
    compress_ratios: tuple[int, ...]
    hc_mult: int
    rms_norm_eps: float
    expert_dtype: str = "fp4"
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    sliding_window: int = 128
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    rope_theta: float = 10000.0
    index_n_heads: int = 64
    index_head_dim: int = 128
    weight_block_size: tuple[int, int] = (128, 128)
    scale_fmt: str = "ue8m0"
    # the vision tower (0 layers: the text model); see VISION_KEYS
    vision_n_layers: int = 0
    vision_dim: int = 0
    vision_n_heads: int = 0
    vision_inter_dim: int = 0
    vision_patch_size: int = 0
    vision_downsample_ratio: int = 0
    # the DSpark draft (empty dspark_target_layer_ids: a classic MTP draft); see DSPARK_KEY
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 0
    dspark_block_size: int | None = None
    n_mtp_layers: int | None = None
    enable_confidence_head: bool = True
    draft_vocab_size: int | None = None
    # DeepSeek V4.1 (model_type deepseek_v41): see V41_MODEL_TYPE
    model_type: str = "deepseek_v4"
    kv_source_layer_ids: tuple[int, ...] = ()
    index_source_layer_ids: tuple[int, ...] = ()
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 0
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    engram_vocab_size: int = 0
    engram_compressed_vocab_size: int = 0
    dspark_n_routed_experts: int | None = None
    dspark_num_experts_per_tok: int | None = None
    # NVIDIA's NVFP4 exports: quantization_config.moe_quant_algo and ignore (ckpt_tool.checkpoint.expert_format)
    moe_quant: MoeQuant = MoeQuant()
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def mtp_layer_ids(self) -> list[int]:
        """Engine layer index S = num_hidden_layers + i of every MTP layer i."""
        return [self.num_hidden_layers + i for i in range(self.num_nextn_predict_layers)]

    @property
    def is_dspark(self) -> bool:
        """Whether ``mtp.*`` holds DSpark stages (config.json names ``dspark_target_layer_ids``)."""
        return bool(self.dspark_target_layer_ids)

    @property
    def draft_layers(self) -> int:
        """How many draft layers vLLM builds: DSpark stages (``n_mtp_layers``, else 3: vLLM's DSpark model does
        not fall back to ``num_nextn_predict_layers`` for V4), or classic MTP layers (``num_nextn_predict_layers``)."""
        if self.is_dspark and self.is_v41:  # vllm/models/deepseek_v41/nvidia/dspark.py: n_mtp_layers, nextn, 3
            return self.n_mtp_layers or self.num_nextn_predict_layers or DSPARK_DEFAULT_STAGES
        if self.is_dspark:
            return self.n_mtp_layers or DSPARK_DEFAULT_STAGES
        return self.num_nextn_predict_layers

    @property
    def is_v41(self) -> bool:
        """Whether vLLM serves this config as DeepSeek V4.1 (``model_type: deepseek_v41``)."""
        return self.model_type == V41_MODEL_TYPE

    @property
    def is_vision(self) -> bool:
        """Whether vLLM serves this config as the vision model (``vision_n_layers > 0``)."""
        return self.vision_n_layers > 0

    def compress_ratio(self, layer: int) -> int:
        """Compress ratio of main layer ``layer`` (0 = sliding window only)."""
        return int(self.compress_ratios[layer]) if layer < len(self.compress_ratios) else 0

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "config.json") -> V4Config:
        if not isinstance(raw, dict):
            raise CheckpointError(
                f"{where}: expected a JSON object, got {type(raw).__name__}; use the model's released config.json"
            )
        original = raw
        if raw.get("model_type") == V41_MODEL_TYPE:
            raw = flatten_v41(raw, where)
        missing = [k for k in REQUIRED_KEYS if k not in raw]
        if missing:
            raise CheckpointError(
                f"{where}: missing required key(s) {', '.join(missing)}; "
                "a DeepSeek V4 config.json carries them all (as the released deepseek-ai/DeepSeek-V4-Flash one does); "
                "use the model's released config.json"
            )
        for key, typ in REQUIRED_KEYS.items():
            value = raw[key]
            if isinstance(value, bool) or not isinstance(value, typ):
                expected = " or ".join(t.__name__ for t in (typ if isinstance(typ, tuple) else (typ,)))
                raise CheckpointError(
                    f"{where}: key {key!r} has value {value!r}, expected {expected}; use the model's released "
                    "config.json"
                )
        if raw["num_nextn_predict_layers"] < 0 or raw["num_hidden_layers"] < 0:
            raise CheckpointError(
                f"{where}: num_hidden_layers and num_nextn_predict_layers must be >= 0; use the model's released "
                "config.json"
            )
        check_types(raw, original, where)  # every key's JSON type as vLLM reads it (config_keys: the table)
        try:
            config = replace(cls._build(raw), raw=original)
        except (TypeError, ValueError, AttributeError, IndexError) as exc:
            raise CheckpointError(
                f"{where}: a value has the wrong type or form ({exc}); compare with the model's released config.json"
            ) from None
        check_values(raw, original, where)  # layer ids in range, sizes that agree (config_keys)
        return config

    @classmethod
    def _build(cls, raw: dict[str, Any]) -> V4Config:
        where = "config.json"
        expert_dtype = raw.get("expert_dtype", "fp4")
        if expert_dtype not in ("fp4", "fp8"):
            raise CheckpointError(
                f"{where}: expert_dtype {expert_dtype!r} is not 'fp4' or 'fp8'; use the model's released config.json"
            )
        vision: dict[str, int] = {}
        if raw.get("vision_n_layers", 0):
            vision["vision_n_layers"] = int(raw["vision_n_layers"])
            missing = [k for k in VISION_KEYS if not isinstance(raw.get(k), int) or isinstance(raw.get(k), bool)]
            if missing:
                raise CheckpointError(
                    f"{where}: vision_n_layers is {raw['vision_n_layers']} but {', '.join(missing)} "
                    "missing or not an integer; vLLM's vision model reads them all: use the model's released "
                    "config.json"
                )
            vision.update((k, raw[k]) for k in VISION_KEYS)
        dspark = _dspark_fields(raw, where)
        quant = raw.get("quantization_config") or {}
        block = tuple(quant.get("weight_block_size", (128, 128)))
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_nextn_predict_layers=raw["num_nextn_predict_layers"],
            num_attention_heads=raw["num_attention_heads"],
            head_dim=raw["head_dim"],
            qk_rope_head_dim=raw["qk_rope_head_dim"],
            q_lora_rank=raw["q_lora_rank"],
            o_groups=raw["o_groups"],
            o_lora_rank=raw["o_lora_rank"],
            n_routed_experts=raw["n_routed_experts"],
            n_shared_experts=raw["n_shared_experts"],
            num_experts_per_tok=raw["num_experts_per_tok"],
            moe_intermediate_size=raw["moe_intermediate_size"],
            num_hash_layers=raw["num_hash_layers"],
            compress_ratios=tuple(int(x) for x in raw["compress_ratios"]),
            hc_mult=raw["hc_mult"],
            rms_norm_eps=float(raw["rms_norm_eps"]),
            expert_dtype=expert_dtype,
            hc_sinkhorn_iters=int(raw.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(raw.get("hc_eps", 1e-6)),
            sliding_window=int(raw.get("sliding_window", 128)),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.5)),
            swiglu_limit=float(raw.get("swiglu_limit", 10.0)),
            scoring_func=str(raw.get("scoring_func", "sqrtsoftplus")),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            index_n_heads=int(raw.get("index_n_heads", 64)),
            index_head_dim=int(raw.get("index_head_dim", 128)),
            weight_block_size=(int(block[0]), int(block[1])),
            scale_fmt=str(quant.get("scale_fmt", "ue8m0")),
            moe_quant=moe_quant_of(raw),
            **vision,
            **dspark,
            **_v41_fields(raw),
            raw=raw,
        )

    @classmethod
    def load(cls, path: Path) -> V4Config:
        """Read and validate ``config.json`` at ``path``."""
        if not path.is_file():
            raise CheckpointError(
                f"{path}: config.json not found; the checkpoint folder must contain the model's config.json"
            )
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, ints over the digit limit, deep nesting
            raise CheckpointError(
                f"{path}: not valid JSON ({json_problem(exc)}); use the model's released config.json"
            ) from None
        return cls.from_dict(raw, where=str(path))


def _dspark_fields(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """The DSpark keys of ``raw`` (none when it does not name ``dspark_target_layer_ids``), checked as vLLM's DSpark
    model reads them: the target layers a non-empty list of ints, the Markov rank a positive int."""
    ids = raw.get(DSPARK_KEY)
    if ids is None:
        return {}
    if not isinstance(ids, list) or not ids or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise CheckpointError(
            f"{where}: {DSPARK_KEY} is {ids!r}, not a non-empty list of layer numbers; use the model's released "
            "config.json"
        )
    bad = [k for k in ("dspark_markov_rank",) if not _positive_int(raw.get(k))]
    bad += [
        k
        for k in ("n_mtp_layers", "dspark_block_size", "draft_vocab_size")
        if k in raw and raw[k] is not None and not _positive_int(raw[k])
    ]
    if bad:
        raise CheckpointError(
            f"{where}: {DSPARK_KEY} makes this a DSpark checkpoint, but {', '.join(bad)} "
            f"{'is' if len(bad) == 1 else 'are'} missing or not a positive integer; vLLM's DSpark draft "
            "(vllm/models/deepseek_v4/nvidia/dspark.py) reads them: use the model's released config.json"
        )
    return {
        "dspark_target_layer_ids": tuple(ids),
        "dspark_markov_rank": raw["dspark_markov_rank"],
        "dspark_block_size": raw.get("dspark_block_size"),
        "n_mtp_layers": raw.get("n_mtp_layers"),
        "enable_confidence_head": raw.get("enable_confidence_head", True) is not False,
        "draft_vocab_size": raw.get("draft_vocab_size"),
    }


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
