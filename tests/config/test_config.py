"""config.json and generation_config.json: official files, both transformers layouts, and clear
refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from nanoqwen import LLM, ConfigError
from nanoqwen.config.model import GenerationConfig, Qwen3Config

ASSETS = Path(__file__).resolve().parents[2] / "nanoqwen" / "assets"
QWEN3_0_6B = ASSETS / "qwen3-0.6b"
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


def official_path(name: str) -> Path:
    return (QWEN3_0_6B / "config.json" if name == "Qwen3-0.6B"
            else ASSETS / "configs" / f"{name}.json")


def official(name: str = "Qwen3-0.6B") -> dict:
    return json.loads(official_path(name).read_text())


def transformers5_layout(raw: dict) -> dict:
    """The same config as transformers 5 writes it: rope_parameters instead of
    rope_theta/rope_scaling, dtype."""
    new = {k: v for k, v in raw.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    new["rope_parameters"] = {"rope_theta": raw["rope_theta"],
                              **(raw.get("rope_scaling") or {"rope_type": "default"})}
    new["dtype"] = raw["torch_dtype"]
    return new


# name: (layers, hidden, intermediate, heads, kv heads, tied) -- from the model cards / hub
# config.json files
OFFICIAL = {
    "Qwen3-0.6B": (28, 1024, 3072, 16, 8, True),
    "Qwen3-1.7B": (28, 2048, 6144, 16, 8, True),
    "Qwen3-4B": (36, 2560, 9728, 32, 8, True),
    "Qwen3-8B": (36, 4096, 12288, 32, 8, False),
    "Qwen3-14B": (40, 5120, 17408, 40, 8, False),
    "Qwen3-32B": (64, 5120, 25600, 64, 8, False),
}


@pytest.mark.parametrize("name", list(OFFICIAL))
def test_official_configs(name):
    layers, hidden, inter, heads, kv_heads, tied = OFFICIAL[name]
    cfg = Qwen3Config.from_file(official_path(name))
    assert (cfg.num_hidden_layers, cfg.hidden_size,
            cfg.intermediate_size) == (layers, hidden, inter)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (heads, kv_heads)
    assert cfg.num_kv_groups == heads // kv_heads
    # explicit in every Qwen3 config; not hidden/heads (64 for 0.6B, 80 for 32B)
    assert cfg.head_dim == 128
    assert cfg.tie_word_embeddings is tied
    assert cfg.vocab_size == 151936 and cfg.max_position_embeddings == 40960
    assert cfg.rope_theta == 1_000_000.0 and cfg.rope_scaling is None
    assert cfg.rms_norm_eps == 1e-6 and cfg.attention_bias is False
    assert (cfg.torch_dtype == "bfloat16" and cfg.eos_token_id == [151645]
            and cfg.bos_token_id == 151643)


@pytest.mark.parametrize("name", list(OFFICIAL))
def test_transformers5_layout_gives_the_same_config(name):
    raw = official(name)
    new = transformers5_layout(raw)
    assert "rope_theta" not in new and "torch_dtype" not in new
    assert Qwen3Config.from_dict(new) == Qwen3Config.from_dict(raw)


def test_dtype_of_transformers5_layout_is_read():
    raw = dict(official(), torch_dtype="float32")
    assert Qwen3Config.from_dict(transformers5_layout(raw)).torch_dtype == "float32"
    with pytest.raises(ConfigError, match="'int8'"):
        Qwen3Config.from_dict(dict(transformers5_layout(raw), dtype="int8"))


def test_layout_written_by_transformers5_itself(tmp_path):
    """What transformers' own save_pretrained writes (whatever its version) parses to the
    official config."""
    transformers = pytest.importorskip("transformers")
    for rope_scaling, max_pos in [(None, 40960), (YARN, 131072)]:
        raw = dict(official(), rope_scaling=rope_scaling, max_position_embeddings=max_pos)
        # it edits its input
        transformers.Qwen3Config(**json.loads(json.dumps(raw))).save_pretrained(tmp_path)
        written = Qwen3Config.from_file(tmp_path / "config.json")
        assert written == Qwen3Config.from_dict(raw)
        assert written.rope_theta == 1_000_000.0
        assert written.rope_scaling == (dict(YARN) if rope_scaling else None)


def test_yarn_in_both_layouts():
    raw = dict(official(), rope_scaling=dict(YARN), max_position_embeddings=131072)
    old = Qwen3Config.from_dict(raw)
    assert old.rope_scaling == YARN and old.rope_theta == 1_000_000.0
    new = Qwen3Config.from_dict(transformers5_layout(raw))
    assert new == old
    # the pre-4.45 spelling "type" instead of "rope_type"
    legacy = dict(raw, rope_scaling={"type": "yarn", "factor": 4.0,
                                     "original_max_position_embeddings": 32768})
    assert Qwen3Config.from_dict(legacy) == old
    # rope_parameters and a top-level rope_theta that agree are fine too
    assert Qwen3Config.from_dict(dict(transformers5_layout(raw), rope_theta=1_000_000)) == old


def test_yarn_without_factor_is_refused():
    raw = dict(official(), rope_scaling={"rope_type": "yarn",
                                         "original_max_position_embeddings": 32768})
    with pytest.raises(ConfigError, match="'factor'"):
        Qwen3Config.from_dict(raw)


def test_contradictory_rope_theta_names_both():
    raw = dict(transformers5_layout(official()), rope_theta=500000)
    with pytest.raises(ConfigError,
                       match=r"rope_theta=500000 .*rope_parameters\.rope_theta=1000000"):
        Qwen3Config.from_dict(raw)


def test_contradictory_rope_scaling_is_refused():
    # yarn at the top, default inside
    raw = dict(transformers5_layout(official()), rope_scaling=dict(YARN))
    with pytest.raises(ConfigError, match="rope_scaling=.*contradicts rope_parameters"):
        Qwen3Config.from_dict(raw)


REQUIRED = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "max_position_embeddings", "rope_theta", "architectures"]


@pytest.mark.parametrize("name", REQUIRED)
def test_missing_required_field_is_named(name):
    raw = official()
    del raw[name]
    with pytest.raises(ConfigError, match=f"'{name}'.*missing") as err:
        Qwen3Config.from_dict(raw, where="some/config.json")
    assert "some/config.json" in str(err.value)
    raw[name] = None  # null counts as missing
    with pytest.raises(ConfigError, match=f"'{name}'"):
        Qwen3Config.from_dict(raw)


def test_missing_rope_theta_in_transformers5_layout():
    raw = transformers5_layout(official())
    del raw["rope_parameters"]["rope_theta"]
    with pytest.raises(ConfigError, match="rope_theta"):
        Qwen3Config.from_dict(raw)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="config.json not found"):
        Qwen3Config.from_file(tmp_path / "config.json")


@pytest.mark.parametrize("value", ["1024", 1.5, True, -4, 0])
def test_bad_integer_field_is_refused(value):
    with pytest.raises(ConfigError, match="hidden_size"):
        Qwen3Config.from_dict(dict(official(), hidden_size=value))


@pytest.mark.parametrize("kv_heads", [3, 6, 32, -8])
def test_kv_heads_must_divide_attention_heads(kv_heads):
    message = "must be a positive integer" if kv_heads < 0 else "must divide num_attention_heads=16"
    with pytest.raises(ConfigError, match=rf"num_key_value_heads\W+{kv_heads}.*"
                                          rf"|num_key_value_heads.*{message}"):
        Qwen3Config.from_dict(dict(official(), num_key_value_heads=kv_heads))


def test_missing_kv_heads_means_multi_head_attention():
    raw = official()
    del raw["num_key_value_heads"]
    cfg = Qwen3Config.from_dict(raw)
    assert cfg.num_key_value_heads == 16 and cfg.num_kv_groups == 1


def test_head_dim_defaults_to_hidden_over_heads_and_must_be_even():
    raw = official()
    del raw["head_dim"]
    assert Qwen3Config.from_dict(raw).head_dim == 1024 // 16
    with pytest.raises(ConfigError, match="head_dim=63"):
        Qwen3Config.from_dict(dict(official(), head_dim=63))


def test_unsupported_architecture_is_refused_by_name(tmp_path):
    raw = dict(official(), architectures=["Qwen2MoeForCausalLM"])
    with pytest.raises(ConfigError,
                       match="'Qwen2MoeForCausalLM' is not supported.*Qwen3MoeForCausalLM"):
        Qwen3Config.from_dict(raw, where="x/config.json")
    # and through the front door, before any weight is looked for
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="Qwen2MoeForCausalLM"):
        LLM(tmp_path / "m")


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"type": "longrope", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192},
])
def test_unsupported_rope_type_is_refused(scaling):
    name = scaling.get("rope_type") or scaling["type"]
    raw = dict(official(), rope_scaling=scaling)
    with pytest.raises(ConfigError, match=f"rope type '{name}' is not supported"):
        Qwen3Config.from_dict(raw)
    with pytest.raises(ConfigError, match=f"rope type '{name}' is not supported"):
        Qwen3Config.from_dict(transformers5_layout(raw))


def test_sliding_window_and_unknown_dtype_are_refused():
    with pytest.raises(ConfigError, match="use_sliding_window"):
        Qwen3Config.from_dict(dict(official(), use_sliding_window=True))
    with pytest.raises(ConfigError, match="'float8'"):
        Qwen3Config.from_dict(dict(official(), torch_dtype="float8"))


def test_generation_config_of_qwen3_0_6b():
    g = GenerationConfig.from_file(QWEN3_0_6B / "generation_config.json", fallback_eos=[1])
    assert g.eos_token_id == [151645, 151643]  # <|im_end|> and <|endoftext|>
    assert (g.temperature, g.top_k, g.top_p, g.min_p, g.do_sample) == (0.6, 20, 0.95, None, True)


def test_generation_config_missing_file_and_single_eos(tmp_path):
    g = GenerationConfig.from_file(tmp_path / "generation_config.json", fallback_eos=[151645])
    assert g.eos_token_id == [151645] and g.temperature is None
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7,
                                                                 "do_sample": False}))
    g = GenerationConfig.from_file(tmp_path / "generation_config.json", fallback_eos=[151645])
    assert g.eos_token_id == [7] and g.do_sample is False
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": ["<|im_end|>"]}))
    with pytest.raises(ConfigError, match="eos_token_id"):
        GenerationConfig.from_file(tmp_path / "generation_config.json")


def test_llm_default_sampling_params_follow_generation_config(tiny_dir, tmp_path):
    llm = LLM(tiny_dir, dtype="float32", device="cpu", max_model_len=32)
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.6, 20, 0.95, 0.0)
    assert llm.llm_engine.eos_token_ids == {151645, 151643}

    # a model whose generation_config says do_sample=false defaults to greedy
    greedy_dir = shutil.copytree(tiny_dir, tmp_path / "greedy")
    (greedy_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 151645,
                                                                   "do_sample": False}))
    llm = LLM(greedy_dir, dtype="float32", device="cpu", max_model_len=32)
    p = llm.get_default_sampling_params()
    assert p.temperature == 0 and p.top_k == -1 and p.top_p == 1.0
    assert llm.llm_engine.eos_token_ids == {151645}


@pytest.mark.parametrize("name", list(OFFICIAL))
def test_to_dict_round_trips(name):
    cfg = Qwen3Config.from_file(official_path(name))
    d = cfg.to_dict()
    assert json.loads(json.dumps(d)) == d  # plain JSON
    assert Qwen3Config.from_dict(d) == cfg
    assert d["rope_theta"] == 1_000_000.0 and d["torch_dtype"] == "bfloat16"  # the original layout
    assert {k: d[k] for k in OFFICIAL_KEYS} == {k: official(name)[k] for k in OFFICIAL_KEYS}


OFFICIAL_KEYS = ["architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings",
                 "eos_token_id", "vocab_size", "max_position_embeddings", "model_type",
                 "hidden_act"]


def test_to_dict_round_trips_yarn_and_bias():
    raw = dict(official(), rope_scaling=dict(YARN, beta_fast=32), attention_bias=True,
               eos_token_id=[1, 2])
    cfg = Qwen3Config.from_dict(transformers5_layout(raw))
    assert (cfg.rope_scaling == dict(YARN, beta_fast=32) and cfg.attention_bias
            and cfg.eos_token_id == [1, 2])
    assert Qwen3Config.from_dict(cfg.to_dict()) == cfg
