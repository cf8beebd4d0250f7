"""Loading checkpoints: tied heads, shards, peak memory, the progress bar, and what init-random
writes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import prompt_logits, tiny_config
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import nanoqwen.model_loader.loader as loader
from nanoqwen import LLM, WeightsError
from nanoqwen.config.model import Qwen3Config
from nanoqwen.model_loader.init_random import QWEN3_0_6B, write_random_model
from nanoqwen.models.qwen3 import Qwen3ForCausalLM

PROMPT = [9707, 11, 847, 829, 374, 1207, 16948, 13, 358, 1075, 311, 3270, 2038]


def file_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def expected_params(path: Path, config: Qwen3Config) -> dict[str, torch.Tensor]:
    """What every nanoqwen parameter must hold, rebuilt from the checkpoint files without the
    loader."""
    t = file_tensors(path)
    exp = {"embed_tokens.weight": t["model.embed_tokens.weight"],
           "norm.weight": t["model.norm.weight"]}
    if not config.tie_word_embeddings:
        exp["lm_head.weight"] = t["lm_head.weight"]
    for i in range(config.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight",
                     "self_attn.q_norm.weight", "self_attn.k_norm.weight"):
            exp[dst + name] = t[src + name]
        exp[dst + "self_attn.qkv_proj.weight"] = torch.cat([t[src + f"self_attn.{n}_proj.weight"]
                                                            for n in "qkv"])
        exp[dst + "self_attn.o_proj.weight"] = t[src + "self_attn.o_proj.weight"]
        exp[dst + "mlp.gate_up_proj.weight"] = torch.cat([t[src + f"mlp.{n}_proj.weight"]
                                                          for n in ("gate", "up")])
        exp[dst + "mlp.down_proj.weight"] = t[src + "mlp.down_proj.weight"]
    return exp


def assert_params_equal_files(model: Qwen3ForCausalLM, path: Path) -> None:
    params = dict(model.named_parameters())
    expected = expected_params(path, model.config)
    assert set(params) == set(expected)
    for name, value in expected.items():
        assert torch.equal(params[name], value.to(params[name].dtype)), name


# ---------------------------------------------------------------- (a) tied embeddings


@pytest.fixture(scope="module")
def tied_dirs(checkpoint, tmp_path_factory) -> dict[str, Path]:
    """The same tied checkpoint twice: as init-random writes it (no lm_head.weight), and with the
    head stored."""
    plain = checkpoint("gqa1-tied-headdim", dtype="float32")
    with_head = tmp_path_factory.mktemp("tied-with-head") / "m"
    shutil.copytree(plain, with_head)
    tensors = load_file(with_head / "model.safetensors")
    assert "lm_head.weight" not in tensors
    # stored separately, same values
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, with_head / "model.safetensors", metadata={"format": "pt"})
    return {"no-lm-head": plain, "lm-head-in-file": with_head}


@pytest.mark.parametrize("variant", ["no-lm-head", "lm-head-in-file"])
def test_tied_head_is_the_embedding_and_matches_transformers(tied_dirs, variant):
    transformers = pytest.importorskip("transformers")
    path = tied_dirs[variant]
    with safe_open(path / "model.safetensors", framework="pt") as f:
        assert ("lm_head.weight" in f.keys()) == (variant == "lm-head-in-file")
    model = LLM(path, dtype="float32", device="cpu", max_model_len=64).llm_engine.model
    assert model.is_tied and model.lm_head.weight is model.embed_tokens.weight
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    vocab_sized = [n for n, p in model.named_parameters() if p.shape[0] == model.config.vocab_size]
    assert vocab_sized == ["embed_tokens.weight"]  # one vocab x hidden matrix in memory, not two
    assert_params_equal_files(model, path)

    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = ref(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(prompt_logits(model, PROMPT), expected, atol=1e-4, rtol=0)


def test_tied_config_with_a_different_stored_head_uses_it_like_transformers(tied_dirs, tmp_path):
    """transformers unties a tied config whose file stores a head with other values; so must we."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "m"
    shutil.copytree(tied_dirs["no-lm-head"], path)
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = torch.randn_like(tensors["model.embed_tokens.weight"]) * 0.08
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    model = LLM(path, dtype="float32", device="cpu", max_model_len=64).llm_engine.model
    assert not model.is_tied and torch.equal(model.lm_head.weight, tensors["lm_head.weight"])
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = ref(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(prompt_logits(model, PROMPT), expected, atol=1e-4, rtol=0)


def test_untied_head_is_its_own_matrix(checkpoint):
    path = checkpoint("gqa2-untied", dtype="float32")
    model = LLM(path, dtype="float32", device="cpu", max_model_len=64).llm_engine.model
    assert not model.is_tied
    assert model.lm_head.weight.data_ptr() != model.embed_tokens.weight.data_ptr()
    assert not torch.equal(model.lm_head.weight, model.embed_tokens.weight)
    assert_params_equal_files(model, path)


def test_bfloat16_file_loaded_as_float32_is_converted_exactly(checkpoint):
    path = checkpoint("gqa2-untied", dtype="bfloat16")
    model = LLM(path, dtype="float32", device="cpu", max_model_len=64).llm_engine.model
    assert model.embed_tokens.weight.dtype == torch.float32
    assert_params_equal_files(model, path)  # bfloat16 -> float32 is exact


# ---------------------------------------------------------------- (b) shards


def test_sharded_checkpoint_loads_the_same_parameters(checkpoint):
    single = checkpoint("gqa4-sharded", dtype="float32")
    sharded = checkpoint("gqa4-sharded", dtype="float32", max_shard_bytes=2 << 20)
    assert sorted(p.name for p in single.glob("*.safetensors")) == ["model.safetensors"]
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) >= 3 and "model.safetensors" not in shards
    assert (sharded / "model.safetensors.index.json").is_file()

    a = dict(LLM(single, dtype="float32", device="cpu",
                 max_model_len=64).llm_engine.model.named_parameters())
    b_model = LLM(sharded, dtype="float32", device="cpu", max_model_len=64).llm_engine.model
    b = dict(b_model.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # and both hold the file's values, not two equal zero buffers
    assert_params_equal_files(b_model, sharded)


def test_shard_missing_from_disk_is_named(checkpoint, tmp_path):
    sharded = shutil.copytree(checkpoint("gqa4-sharded", dtype="float32", max_shard_bytes=2 << 20),
                              tmp_path / "m")
    victim = sorted(sharded.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(WeightsError, match=victim.name):
        LLM(sharded, dtype="float32", device="cpu")


# ---------------------------------------------------------------- (c) peak memory

MEMORY_SCRIPT = r"""
import json, sys, threading, time

def status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, value = line.split(":", 1)
            if key in ("VmRSS", "VmHWM", "RssAnon"):
                out[key] = int(value.split()[0]) * 1024
    return out

from nanoqwen import LLM

sys.setswitchinterval(1e-4)
before = status()
peak_anon = [before["RssAnon"]]
done = threading.Event()

# the anonymous (heap) memory is not tracked by the kernel's high-water mark: sample it
def sample():
    while not done.is_set():
        peak_anon[0] = max(peak_anon[0], status()["RssAnon"])
        time.sleep(0.001)

thread = threading.Thread(target=sample, daemon=True)
thread.start()
# loading only
llm = LLM(sys.argv[1], dtype="float32", device="cpu", max_model_len=64, enforce_eager=True)
done.set()
thread.join()
after = status()
print(json.dumps({"rss_before": before["VmRSS"], "anon_before": before["RssAnon"],
                  "hwm_after": after["VmHWM"], "anon_peak": max(peak_anon[0], after["RssAnon"])}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").is_file(),
                    reason="reads Linux /proc/self/status")
def test_peak_memory_while_loading_stays_near_the_weights(tmp_path):
    # hidden 512, 8 layers, tied, float32: a 412 MB file, 311 MB of it the embedding.
    raw = tiny_config(hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                      tie_word_embeddings=True)
    path = write_random_model(tmp_path / "m", raw, dtype="float32")
    size = (path / "model.safetensors").stat().st_size
    result = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(path)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    m = json.loads(result.stdout.strip().splitlines()[-1])
    anon = (m["anon_peak"] - m["anon_before"]) / size
    rss = (m["hwm_after"] - m["rss_before"]) / size
    # As multiples of the file size: the heap grows by the parameters (1.0x) plus the tokenizer; the
    # peak RSS stays near that because the loader reopens the file every 128 MB and reads big
    # tensors in row blocks, so at most one 128 MB group of mapped pages is resident besides the
    # parameters (a single map held open for the whole file goes past the RSS bound). One extra full
    # copy of the weights held while loading (`sd = {k: v.clone() for k, v in load_file(f).items()}`
    # before load_weights) goes past both bounds.
    assert anon < 1.5, (f"heap grew by {anon:.2f}x the checkpoint size while loading "
                        "(a second copy?)")
    assert rss < 1.75, f"peak RSS grew by {rss:.2f}x the checkpoint size while loading"


# ---------------------------------------------------------------- (d) progress bar


def empty_model(path: Path) -> tuple[Qwen3ForCausalLM, list[Path]]:
    config = loader.load_config(path)
    with torch.device("cpu"):
        model = Qwen3ForCausalLM(config, 64)
    return model, loader.safetensors_files(path)


def test_progress_bar_on_request_and_off_by_default(tiny_dir, capsys, monkeypatch):
    model, files = empty_model(tiny_dir)
    loader.load_weights(model, files, show_progress=True)
    err = capsys.readouterr().err
    assert "Loading weights" in err and "100%" in err
    size_mb = sum(f.stat().st_size for f in files) / 1e6
    assert f"{size_mb:.1f}M" in err  # counted in bytes, the whole checkpoint

    loader.load_weights(model, files)  # a small checkpoint: no bar
    assert capsys.readouterr() == ("", "")
    loader.load_weights(model, files, show_progress=False)
    assert capsys.readouterr() == ("", "")

    monkeypatch.setattr(loader, "PROGRESS_BAR_MIN_BYTES", 1)  # as if the checkpoint were big
    loader.load_weights(model, files)
    assert "Loading weights" in capsys.readouterr().err
    assert_params_equal_files(model, tiny_dir)


def test_llm_on_a_small_checkpoint_prints_no_bar(tiny_dir, capfd):
    LLM(tiny_dir, dtype="float32", device="cpu", max_model_len=32)
    out, err = capfd.readouterr()
    assert "Loading weights" not in err and "Loading weights" not in out


# ---------------------------------------------------------------- (e) what init-random writes

HF_FILES = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}


def transformers_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        del shapes["lm_head.weight"]  # the hub's tied checkpoints do not store it
    return shapes


@pytest.mark.parametrize("case", ["tied", "untied", "bias-sharded"])
def test_init_random_writes_a_hub_shaped_folder(tmp_path, case):
    overrides = {"tied": {}, "untied": {"tie_word_embeddings": False},
                 "bias-sharded": {"tie_word_embeddings": False, "attention_bias": True}}[case]
    shard = 1 << 20 if "sharded" in case else 2 << 30
    path = write_random_model(tmp_path / "m", tiny_config(**overrides), dtype="bfloat16",
                              max_shard_bytes=shard)
    names = {p.name for p in path.iterdir()}
    if "sharded" in case:
        shards = names - HF_FILES - {"model.safetensors.index.json"}
        n = len(shards)
        assert n >= 3 and shards == {f"model-{i:05d}-of-{n:05d}.safetensors"
                                     for i in range(1, n + 1)}
        assert names == HF_FILES | shards | {"model.safetensors.index.json"}
        index = json.loads((path / "model.safetensors.index.json").read_text())
        located = {}
        for shard_file in shards:
            with safe_open(path / shard_file, framework="pt") as f:
                located.update({name: shard_file for name in f.keys()})
        assert index["weight_map"] == located  # every tensor, in the file that holds it
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                      for t in file_tensors(path).values())
    else:
        assert names == HF_FILES | {"model.safetensors"}

    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (path / name).read_bytes() == (QWEN3_0_6B / name).read_bytes(), name
    config = json.loads((path / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"
    assert config == {**tiny_config(**overrides), "torch_dtype": "bfloat16"}

    tensors = file_tensors(path)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == transformers_shapes(path)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    with safe_open(next(path.glob("*.safetensors")), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}  # transformers refuses files without it


def test_init_random_rewrite_leaves_no_stale_shards(tmp_path):
    path = write_random_model(tmp_path / "m", "tiny", max_shard_bytes=1 << 20)
    assert (path / "model.safetensors.index.json").is_file()
    write_random_model(path, "tiny")
    assert {p.name for p in path.iterdir()} == HF_FILES | {"model.safetensors"}
    LLM(path, dtype="float32", device="cpu", max_model_len=32)  # and it loads


def test_init_random_same_seed_same_weights(tmp_path):
    a = file_tensors(write_random_model(tmp_path / "a", "tiny", seed=3))
    b = file_tensors(write_random_model(tmp_path / "b", "tiny", seed=3, max_shard_bytes=1 << 20))
    c = file_tensors(write_random_model(tmp_path / "c", "tiny", seed=4))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"],
                           c["model.layers.0.mlp.up_proj.weight"])
    norm = a["model.layers.0.input_layernorm.weight"].float()
    assert 0.5 < norm.mean() < 1.5 and norm.std() > 0  # norms near one but not all one


@pytest.mark.parametrize("preset", ["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b",
                                    "qwen3-14b", "qwen3-32b"])
def test_official_preset_tensor_names_and_shapes_match_transformers(tmp_path, preset):
    """What init-random would write for the real sizes (head_dim 128 != hidden/heads), without
    writing it."""
    from nanoqwen.model_loader.init_random import checkpoint_shapes, preset_config

    raw = preset_config(preset)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    got = dict(checkpoint_shapes(Qwen3Config.from_dict(raw)))
    assert got == transformers_shapes(tmp_path)
    assert got["model.layers.0.self_attn.q_proj.weight"] == (raw["num_attention_heads"] * 128,
                                                             raw["hidden_size"])
