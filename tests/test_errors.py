"""Bad input gets one clear nanoqwen error naming the thing, never a raw traceback from deep
inside torch."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from nanoqwen import LLM, ConfigError, InvalidRequestError, ModelNotFoundError, SamplingParams, WeightsError


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanoqwen", *args], capture_output=True,
                          text=True, input=stdin, timeout=120)


def test_folder_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):
        LLM(tmp_path / "empty")


def test_missing_folder_and_unreachable_hub(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        LLM(tmp_path / "nope")
    with pytest.raises(ModelNotFoundError, match="hub is not reachable.*--model PATH.*init-random"):
        LLM("Qwen/Qwen3-NotCachedHere")


def test_truncated_safetensors(tiny_dir, tmp_path):
    bad = copy_model(tiny_dir, tmp_path / "m")
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError, match=r"model\.safetensors.*(truncated|corrupt|readable)"):
        LLM(bad, dtype="float32")


def test_garbage_safetensors(tiny_dir, tmp_path):
    bad = copy_model(tiny_dir, tmp_path / "m")
    (bad / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(WeightsError, match=r"model\.safetensors"):
        LLM(bad, dtype="float32")


def test_missing_tensor_is_named(tiny_dir, tmp_path):
    bad = copy_model(tiny_dir, tmp_path / "m")
    tensors = load_file(bad / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(WeightsError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing"):
        LLM(bad, dtype="float32")


def test_wrong_shape_names_tensor_and_both_shapes(tiny_dir, tmp_path):
    bad = copy_model(tiny_dir, tmp_path / "m")
    tensors = load_file(bad / "model.safetensors")
    name = "model.layers.0.self_attn.k_proj.weight"
    tensors[name] = tensors[name][:32]
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(WeightsError,
                       match=r"k_proj\.weight' has shape \[32, 64\].*implies \[64, 64\]"):
        LLM(bad, dtype="float32")


@pytest.mark.parametrize("name, make", [
    ("model.layers.9.mlp.up_proj.weight", lambda t: t["model.layers.1.mlp.up_proj.weight"].clone()),
    ("model.rotary_emb.scale", lambda t: torch.tensor(1.0)),  # a scalar (0-d) tensor
])
def test_unexpected_tensor_is_named(tiny_dir, tmp_path, name, make):
    bad = copy_model(tiny_dir, tmp_path / "m")
    tensors = load_file(bad / "model.safetensors")
    tensors[name] = make(tensors)
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(WeightsError, match=rf"unexpected tensor '{re.escape(name)}'"):
        LLM(bad, dtype="float32")


def test_unknown_architecture(tiny_dir, tmp_path):
    bad = copy_model(tiny_dir, tmp_path / "m")
    edit_config(bad, architectures=["LlamaForCausalLM"])
    with pytest.raises(ConfigError, match="'LlamaForCausalLM' is not supported"):
        LLM(bad)


def test_corrupt_config_json(tiny_dir, tmp_path):
    bad = copy_model(tiny_dir, tmp_path / "m")
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config\.json is not valid JSON"):
        LLM(bad)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint("tiny", dtype="float32"), dtype="float32", max_model_len=32)


def test_empty_prompt(llm):
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        llm.generate([""], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        llm.generate([[]], use_tqdm=False)


def test_prompt_longer_than_context_and_out_of_vocab_ids(llm):
    with pytest.raises(InvalidRequestError,
                       match="the prompt has 40 tokens but max_model_len is 32"):
        llm.generate([[5] * 40], use_tqdm=False)
    with pytest.raises(InvalidRequestError,
                       match=r"token id 999999 is not in the vocabulary \[0, 151936\)"):
        llm.generate([[1, 999999]], use_tqdm=False)


def test_a_bad_prompt_in_a_batch_leaves_the_engine_serving(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate([[1, 2, 3], [5] * 40], SamplingParams(max_tokens=3), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].token_ids) == 3


def test_cli_errors_are_one_line_and_nonzero(tiny_dir, tmp_path):
    cases = [
        (["generate", "--model", str(tmp_path / "missing"), "--prompt", "hi"], "does not exist"),
        (["generate", "--model", str(tiny_dir), "--prompt", "hi", "--temperature", "-1"],
         "temperature=-1.0"),
        (["generate", "--model", str(tiny_dir), "--prompt", "hi", "--top-p", "1.5"], "top_p=1.5"),
        (["generate", "--model", str(tiny_dir), "--prompt", "", "--no-chat-template"],
         "prompt is empty"),
        (["generate", "--model", str(tiny_dir), "--prompt", "hi " * 40, "--max-model-len", "16"],
         "max_model_len is 16"),
    ]
    for args, message in cases:
        result = run_cli(*args)
        assert result.returncode == 1, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert (len(lines) == 1 and lines[0].startswith("nanoqwen: error:")
                and message in lines[0]), lines
        assert "Traceback" not in result.stderr


@pytest.mark.parametrize("prompt, match", [
    ({"prompt_token_ids": [1, 2], "multi_modal_data": {}}, "key 'multi_modal_data' is not supported"),
    ({"text": "Hi"}, "key 'text' is not supported"),
    ({}, 'needs "prompt"'),
    ({"prompt_token_ids": "1 2 3"}, "prompt_token_ids must be a list"),
    ({"prompt_token_ids": [1, 10**9]}, "not in the vocabulary"),
    (None, "got NoneType"),
])
def test_bad_prompts_name_what_was_given(llm, prompt, match):
    """A prompt that is not a string, token ids or one of vLLM's prompt dicts is one clear error, raised
    before anything is queued."""
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
