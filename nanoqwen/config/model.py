"""A checkpoint's configs, typed: config.json (Qwen3Config) and generation_config.json (GenerationConfig).

Both the original Qwen3 layout (`rope_theta` and `rope_scaling` at the top level) and the
transformers 5 layout (`rope_parameters`; `num_local_experts` for `num_experts`) are accepted.
Dense Qwen3 and Qwen3-MoE configs are read into the same Qwen3Config; a dense one has no
experts.
Anything missing or contradictory is a ConfigError that names the field and the file.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nanoqwen.errors import ConfigError

MOE_ARCHITECTURE = "Qwen3MoeForCausalLM"
# Qwen3Model: the bare decoder (no LM head), as an embedding model may be saved
BARE_ARCHITECTURE = "Qwen3Model"
SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", MOE_ARCHITECTURE, BARE_ARCHITECTURE)
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "decoder_sparse_step", "mlp_only_layers")
SUPPORTED_ROPE_TYPES = ("default", "yarn")
DTYPE_NAMES = ("bfloat16", "float16", "float32")


def read_json(path: Path) -> dict[str, Any]:
    """Read a JSON object from `path`, turning every failure into a ConfigError naming the file."""
    if not path.is_file():
        raise ConfigError(f"{path} not found: a Qwen3 model folder needs {path.name}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); "
                          "re-download or rewrite the file") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object, found {type(data).__name__}")
    return data


def _require(raw: dict, name: str, kind: type | tuple[type, ...], where: str) -> Any:
    if name not in raw or raw[name] is None:
        raise ConfigError(f"{where}: required field '{name}' is missing")
    value = raw[name]
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        raise ConfigError(f"{where}: field '{name}' must be {_kind_name(kind)}, found {value!r}")
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


@dataclass(frozen=True)
class Qwen3Config:
    """The fields of a Qwen3 config.json that the model math needs (names as in transformers)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    # None, or {"rope_type": "yarn", "factor": ..., ...}
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    architectures: tuple[str, ...] = ("Qwen3ForCausalLM",)
    # Qwen3-MoE only (defaults as in transformers); a dense model has num_experts = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.architectures[0] == MOE_ARCHITECTURE

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer `layer_idx` has a sparse MoE block instead of the dense MLP
        (transformers' rule)."""
        return (layer_idx not in self.mlp_only_layers and self.num_experts > 0
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    @property
    def num_kv_groups(self) -> int:
        """Query heads per key/value head (the GQA ratio)."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "config.json") -> Qwen3Config:
        archs = raw.get("architectures")
        if archs is None:
            raise ConfigError(f"{where}: required field 'architectures' is missing; "
                              "expected ['Qwen3ForCausalLM']")
        if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
            raise ConfigError(f"{where}: field 'architectures' must be a list like "
                              f"['Qwen3ForCausalLM'], found {archs!r}")
        if archs[0] not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"{where}: architecture {archs[0]!r} is not supported; "
                f"nanoqwen runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        ints = {
            name: _require(raw, name, int, where)
            for name in (
                "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "max_position_embeddings",
            )
        }
        heads = ints["num_attention_heads"]
        ints["num_key_value_heads"] = (raw["num_key_value_heads"]
                                       if raw.get("num_key_value_heads") is not None else heads)
        ints["head_dim"] = (raw["head_dim"] if raw.get("head_dim") is not None
                            else ints["hidden_size"] // heads)
        for name, value in ints.items():
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{where}: field '{name}' must be a positive integer, "
                                  f"found {value!r}")
        if heads % ints["num_key_value_heads"]:
            raise ConfigError(f"{where}: num_key_value_heads={ints['num_key_value_heads']} "
                              f"must divide num_attention_heads={heads}")
        if ints["head_dim"] % 2:
            raise ConfigError(f"{where}: head_dim={ints['head_dim']} must be even "
                              "(RoPE rotates pairs)")
        if raw.get("use_sliding_window"):
            raise ConfigError(f"{where}: use_sliding_window=true is not supported "
                              "(no Qwen3 checkpoint uses it)")
        rope_theta, rope_scaling = _rope_fields(raw, where)
        eos = raw.get("eos_token_id")
        eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        dtypes = {raw[k] for k in ("torch_dtype", "dtype") if raw.get(k) is not None}
        if len(dtypes) > 1:
            raise ConfigError(f"{where}: torch_dtype={raw['torch_dtype']!r} "
                              f"contradicts dtype={raw['dtype']!r}")
        dtype = dtypes.pop() if dtypes else "bfloat16"
        if dtype not in DTYPE_NAMES:
            raise ConfigError(f"{where}: torch_dtype {dtype!r} is not one of "
                              f"{', '.join(DTYPE_NAMES)}")
        return cls(
            **ints,
            rms_norm_eps=_positive_number(raw.get("rms_norm_eps", 1e-6), "rms_norm_eps", where),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            torch_dtype=dtype,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos_ids,
            architectures=tuple(archs),
            **(_moe_fields(raw, ints["num_hidden_layers"], where)
               if archs[0] == MOE_ARCHITECTURE else {}),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> Qwen3Config:
        path = Path(path)
        return cls.from_dict(read_json(path), where=str(path))

    def to_dict(self) -> dict[str, Any]:
        """The config.json content in the original Qwen3 layout (as the official files are)."""
        d = asdict(self)
        d["architectures"] = list(self.architectures)
        eos = self.eos_token_id
        d["eos_token_id"] = eos[0] if len(eos) == 1 else eos
        d.update(model_type="qwen3", hidden_act="silu", use_sliding_window=False,
                 sliding_window=None, max_window_layers=self.num_hidden_layers,
                 attention_dropout=0.0, use_cache=True)
        if self.is_moe:
            d.update(model_type="qwen3_moe", mlp_only_layers=list(self.mlp_only_layers),
                     router_aux_loss_coef=0.001, output_router_logits=False)
        else:
            for name in MOE_FIELDS:
                del d[name]
        return dict(sorted(d.items()))


def _moe_fields(raw: dict[str, Any], num_layers: int, where: str) -> dict[str, Any]:
    """The expert fields of a Qwen3MoeForCausalLM config (router_aux_loss_coef only matters in
    training)."""
    if raw.get("num_experts") is None and raw.get("num_local_experts") is not None:
        # transformers 5's name
        raw = {**raw, "num_experts": raw["num_local_experts"]}
    elif raw.get("num_local_experts") not in (None, raw.get("num_experts")):
        raise ConfigError(f"{where}: num_experts={raw['num_experts']} contradicts "
                          f"num_local_experts={raw['num_local_experts']}; keep one")
    fields = {name: _require(raw, name, int, where)
              for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size")}
    step = raw.get("decoder_sparse_step")
    fields["decoder_sparse_step"] = step if step is not None else 1
    for name, value in fields.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{where}: field '{name}' must be a positive integer, "
                              f"found {value!r}")
    if fields["num_experts_per_tok"] > fields["num_experts"]:
        raise ConfigError(f"{where}: num_experts_per_tok={fields['num_experts_per_tok']} "
                          f"must not exceed num_experts={fields['num_experts']}")
    norm = raw.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise ConfigError(f"{where}: field 'norm_topk_prob' must be true or false, "
                          f"found {norm!r}")
    only = raw.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                             and 0 <= i < num_layers for i in only):
        raise ConfigError(f"{where}: field 'mlp_only_layers' must be a list of layer indices in "
                          f"[0, {num_layers}), found {only!r}")
    return dict(fields, norm_topk_prob=norm, mlp_only_layers=tuple(sorted(set(only))))


def _positive_number(value: Any, name: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{where}: field '{name}' must be a positive number, "
                          f"found {value!r}")
    return float(value)


def _rope_fields(raw: dict[str, Any], where: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either config layout; refuse a layout that contradicts
    itself."""
    params, top_theta = raw.get("rope_parameters"), raw.get("rope_theta")
    top_scaling = raw.get("rope_scaling")
    for name, value in (("rope_parameters", params), ("rope_scaling", top_scaling)):
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"{where}: field '{name}' must be an object or null, "
                              f"found {value!r}")
    if params is not None:
        theta = params.get("rope_theta", top_theta)
        if top_theta is not None and theta is not None and theta != top_theta:
            raise ConfigError(
                f"{where}: rope_theta={top_theta} contradicts "
                f"rope_parameters.rope_theta={theta}; keep one")
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        if top_scaling and _rope_type(top_scaling) != "default" and (
                _rope_type(scaling) != _rope_type(top_scaling)
                or any(scaling.get(k) != v for k, v in top_scaling.items()
                       if k not in ("type", "rope_type"))):
            raise ConfigError(f"{where}: rope_scaling={top_scaling} "
                              f"contradicts rope_parameters={params}")
    else:
        theta, scaling = top_theta, dict(top_scaling or {})
    if theta is None:
        raise ConfigError(f"{where}: required field 'rope_theta' "
                          "(or rope_parameters.rope_theta) is missing")
    theta = _positive_number(theta, "rope_theta", where)
    rope_type = _rope_type(scaling)
    scaling = {k: v for k, v in scaling.items() if k not in ("type", "rope_type")}
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(f"{where}: rope type {rope_type!r} is not supported; "
                          f"use one of {SUPPORTED_ROPE_TYPES}")
    if rope_type == "default":
        return theta, None
    for name in ("factor", "original_max_position_embeddings"):
        if name not in scaling:
            raise ConfigError(f"{where}: yarn rope scaling needs field '{name}'")
        _positive_number(scaling[name], f"rope_scaling.{name}", where)
    return theta, {"rope_type": rope_type, **scaling}


def _rope_type(scaling: dict[str, Any]) -> str:
    return scaling.get("rope_type") or scaling.get("type") or "default"


@dataclass(frozen=True)
class GenerationConfig:
    """generation_config.json: default stop ids and the model's recommended sampling values."""

    eos_token_id: list[int] = field(default_factory=list)
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    do_sample: bool = True

    @classmethod
    def from_file(cls, path: str | Path, fallback_eos: list[int] | None = None) -> GenerationConfig:
        path = Path(path)
        if not path.is_file():
            return cls(eos_token_id=list(fallback_eos or []))
        raw = read_json(path)
        eos = raw.get("eos_token_id", fallback_eos)
        eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        if not all(isinstance(i, int) for i in eos_ids):
            raise ConfigError(f"{path}: eos_token_id must be an integer or a list of integers, "
                              f"found {eos!r}")
        return cls(
            eos_token_id=eos_ids,
            temperature=raw.get("temperature"),
            top_k=raw.get("top_k"),
            top_p=raw.get("top_p"),
            min_p=raw.get("min_p"),
            do_sample=bool(raw.get("do_sample", True)),
        )


# ---- tensor parallelism: what a model can be split into


def tp_split_sizes(config: Qwen3Config) -> dict[str, int]:
    """The sizes that tensor parallelism splits N ways: each must divide by N."""
    sizes = {"num_attention_heads": config.num_attention_heads,
             # each rank holds whole key/value heads
             "num_key_value_heads": config.num_key_value_heads,
             "intermediate_size": config.intermediate_size,
             "vocab_size": config.vocab_size}
    # MoE models: each expert's columns are split too
    if getattr(config, "moe_intermediate_size", None):
        sizes["moe_intermediate_size"] = config.moe_intermediate_size
    return sizes


def check_tensor_parallel_size(config: Qwen3Config, size: Any) -> None:
    """Refuse a tensor_parallel_size that does not split every head, MLP column and vocabulary
    row evenly."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ConfigError(f"tensor_parallel_size={size!r} must be an integer >= 1")
    sizes = tp_split_sizes(config)
    bad = [f"{name}={value}" for name, value in sizes.items() if value % size]
    if bad:
        common = math.gcd(*sizes.values())
        valid = ", ".join(str(n) for n in range(1, common + 1) if common % n == 0)
        raise ConfigError(f"tensor_parallel_size={size} does not divide {', '.join(bad)} "
                          f"of this model; valid sizes: {valid}")
