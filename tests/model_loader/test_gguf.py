"""GGUF files: the reader against the `gguf` package's, every block type's unpacking against
gguf.quants.dequantize, the tokenizer and chat template rebuilt from metadata against Qwen's files, logits against
transformers running the dequantised weights, the CPU decode kernels against the plain path, and the errors."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import hf_model, matrix_of, prompt_logits, rank_rows, run_cli, tiny_config
from gguf_files import T, random_blocks, write_gguf

from nanoqwen import LLM, ConfigError, ModelNotFoundError, SamplingParams, WeightsError
from nanoqwen.model_loader.gguf_file import GGUFCheckpoint
from nanoqwen.model_loader.hub import resolve_model_path
from nanoqwen.model_loader.init_random import ASSETS
from nanoqwen.model_loader.loader import load_config, load_model, load_tokenizer
from nanoqwen.ops.gguf_quants import BLOCK_SIZES, unpack
from nanoqwen.quantization import Int4Linear, weight_bytes
from nanoqwen.quantization.int8_group import Int8GroupLinear
from nanoqwen.quantization.prequantized import QuantizedEmbedding, StackedLinear
from nanoqwen.tokenizer import Tokenizer

PROMPT = [9707, 11, 847, 829, 374, 1207, 16948, 13, 358, 1075, 311, 3270, 2038]
# K-quant blocks hold 256 weights: every matrix's columns a multiple of 256
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
# what a llama.cpp Q4_K_M file holds (attn_v and ffn_down of some layers Q6_K, the tied table Q6_K), and a mix of
# every other type
Q4_K_M = {"attn_v.weight": T.Q6_K, "ffn_down.weight": T.Q6_K, "token_embd.weight": T.Q6_K}
# what a Q5_K_M file holds, its table in Q5_K (a 5-bit embedding table)
Q5_K_M = {"attn_v.weight": T.Q6_K, "ffn_down.weight": T.Q6_K}
MIXED = {"attn_q.weight": T.Q4_0, "attn_k.weight": T.Q4_1, "attn_v.weight": T.Q5_0, "attn_output.weight": T.Q5_1,
         "ffn_gate.weight": T.Q5_K, "ffn_up.weight": T.Q8_0, "ffn_down.weight": T.BF16, "token_embd.weight": T.Q8_0,
         "output.weight": T.Q4_K}


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    """gguf_model(name, types, default, **config) -> (file, dequantised folder), written once per module."""
    cache: dict[str, tuple[Path, Path]] = {}

    def make(name: str, types: dict, default: T = T.Q4_K, **overrides) -> tuple[Path, Path]:
        if name not in cache:
            raw = tiny_config(**{**SHAPE, **overrides})
            cache[name] = write_gguf(tmp_path_factory.mktemp(name), raw, types, default)
        return cache[name]

    return make


@pytest.mark.parametrize("qtype", list(BLOCK_SIZES), ids=lambda t: t.name)
def test_unpack_equals_gguf_dequantize(qtype):
    """Every block type unpacks to exactly the weights gguf's reference gives (a wrong nibble, bit plane or scale
    order changes values)."""
    rng = np.random.default_rng(int(qtype))
    blocks = random_blocks(rng, T(int(qtype)), rows=24, cols=512)
    ours = unpack(torch.from_numpy(blocks), int(qtype), 512).dequantize().numpy()
    np.testing.assert_array_equal(ours, gguf.quants.dequantize(blocks, T(int(qtype))).astype(np.float32))


def test_reader_equals_gguf_reader(gguf_model):
    path, _ = gguf_model("mixed", MIXED, untied=True, tie_word_embeddings=False)
    ours, theirs = GGUFCheckpoint(path), gguf.GGUFReader(path)
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert set(keys) == set(ours.fields)
    for key in keys:
        value = theirs.fields[key].contents()
        assert ours.fields[key] == pytest.approx(value) if isinstance(value, float) else ours.fields[key] == value
    assert [t.name for t in theirs.tensors] == list(ours.tensors)
    for t in theirs.tensors:
        mine = ours.tensors[t.name]
        assert mine.ggml_type == int(t.tensor_type) and mine.shape == tuple(reversed(t.shape.tolist()))
        assert np.array(mine.data).tobytes() == t.data.tobytes()


@pytest.mark.parametrize("name,types,default,overrides", [
    ("q4_k_m", Q4_K_M, T.Q4_K, {}),
    ("q5_k_m", Q5_K_M, T.Q5_K, {}),
    ("mixed", MIXED, T.Q4_K, {"untied": True, "tie_word_embeddings": False}),
    ("q4_0", {}, T.Q4_0, {}),
    ("f16", {"token_embd.weight": T.F16}, T.F16, {}),
], ids=["q4_k_m", "q5_k_m", "every-type-untied", "q4_0", "f16"])
def test_logits_equal_transformers_on_dequantised_weights(gguf_model, name, types, default, overrides):
    """float32: nanoqwen on the GGUF file computes what transformers computes on the file's weights dequantised by
    gguf's reference, and the greedy tokens are the same."""
    path, ref = gguf_model(name, types, default, **overrides)
    model = load_model(path, load_config(path), torch.float32, torch.device("cpu"))
    theirs_model = hf_model(ref, torch.float32)
    with torch.no_grad():
        theirs = theirs_model(torch.tensor([PROMPT])).logits[0]
    ours = prompt_logits(model, PROMPT)
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    if name != "f16":  # the file's quantised matrices are held as they are, not as model-dtype copies
        assert isinstance(model.embed_tokens, QuantizedEmbedding)
        assert isinstance(model.layers[0].self_attn.o_proj, Int4Linear | Int8GroupLinear)


def test_q4_k_m_layout_and_memory(gguf_model):
    """Q4_K matrices as int4 with the file's two-level scales (6-bit sub-scales, float32 per 8 groups): 152 bytes
    a block of 256 weights for the file's 144; Q6_K ones as grouped int8 with theirs and their values at 6 bits
    (6.625 bits a weight for the file's 6.5625); a tied head shares the embedding table; q/k (Q4_K) beside v
    (Q6_K), each in its own format. The weights in memory within 10% of the file's tensor bytes."""
    path, _ = gguf_model("q4_k_m", Q4_K_M, T.Q4_K)
    model = load_model(path, load_config(path), torch.bfloat16, torch.device("cpu"))
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    gate_up = mlp.gate_up_proj
    assert isinstance(gate_up, Int4Linear) and gate_up.scale.dtype == torch.uint8
    assert gate_up.scale.shape[1] == 256 // 32 and gate_up.super_scale.shape[1] == 1
    assert isinstance(mlp.down_proj, Int8GroupLinear) and mlp.down_proj.offset is None
    assert mlp.down_proj.scale.dtype == torch.int8 and mlp.down_proj.super_scale.shape[1] == 512 // 256
    assert mlp.down_proj.weight.dtype == torch.uint8  # (values at 6 bits)
    # q, k Q4_K with v Q6_K: q and k one int4 matrix, v grouped int8, their outputs side by side
    assert isinstance(attn.qkv_proj, StackedLinear)
    assert [type(p).__name__ for p in attn.qkv_proj.parts] == ["Int4Linear", "Int8GroupLinear"]
    assert model.lm_head is model.embed_tokens.table and model.is_tied
    ckpt = GGUFCheckpoint(path)

    def file_bytes(*names: str) -> int:
        return sum(ckpt.tensors[f"blk.0.{name}.weight"].data.nbytes for name in names)

    assert weight_bytes(gate_up) <= 152 / 144 * file_bytes("ffn_gate", "ffn_up")  # bytes a block of 256
    assert weight_bytes(mlp.down_proj) <= 6.625 / 6.5625 * file_bytes("ffn_down")
    assert weight_bytes(model) <= 1.1 * ckpt.tensor_bytes()


def test_q5_k_m_layout_and_memory(gguf_model):
    """Q5_K matrices as grouped int8 with their values at 5 bits and the file's two-level scales and mins (6-bit
    sub-values, float32 d and -dmin per 8 groups): 5.75 bits a weight for the file's 5.5; Q5_0 and Q5_1 at 5 bits
    with float16 scales and offsets (6 bits a weight; the file's 5.5 and 6). The weights in memory within 10% of the
    file's tensor bytes."""
    path, _ = gguf_model("q5_k_m", Q5_K_M, T.Q5_K)
    model = load_model(path, load_config(path), torch.bfloat16, torch.device("cpu"))
    gate_up = model.layers[0].mlp.gate_up_proj
    assert isinstance(gate_up, Int8GroupLinear) and gate_up.weight.dtype == torch.uint8
    assert gate_up.weight.shape == (1024, 256 * 5 // 8) and gate_up.in_features == 256
    assert gate_up.scale.dtype == gate_up.offset.dtype == torch.uint8 and gate_up.super_offset.shape == (1024, 1)
    assert model.lm_head is model.embed_tokens.table and model.embed_tokens.table.weight.dtype == torch.uint8
    ckpt = GGUFCheckpoint(path)
    gate_up_bytes = sum(ckpt.tensors[f"blk.0.{n}.weight"].data.nbytes for n in ("ffn_gate", "ffn_up"))
    assert weight_bytes(gate_up) <= 5.75 / 5.5 * gate_up_bytes
    assert weight_bytes(model) <= 1.1 * ckpt.tensor_bytes()
    path, _ = gguf_model("q5-legacy", {}, T.Q5_1, tie_word_embeddings=False, untied=True)
    legacy = load_model(path, load_config(path), torch.bfloat16, torch.device("cpu"))
    ckpt = GGUFCheckpoint(path)
    o_proj = legacy.layers[0].self_attn.o_proj
    assert o_proj.weight.dtype == torch.uint8 and o_proj.scale.dtype == o_proj.offset.dtype == torch.float16
    assert weight_bytes(legacy) <= 1.1 * ckpt.tensor_bytes()


def test_q4_0_is_held_at_its_file_size(gguf_model):
    """Q4_0 matrices as symmetric int4 (no offsets: each weight d * (q - 8)) with the file's float16 d: 18 bytes a
    group of 32, as the file's blocks; the tied table too."""
    path, _ = gguf_model("q4_0", {}, T.Q4_0)
    model = load_model(path, load_config(path), torch.bfloat16, torch.device("cpu"))
    o_proj = model.layers[0].self_attn.o_proj
    assert isinstance(o_proj, Int4Linear) and o_proj.offset is None and o_proj.scale.dtype == torch.float16
    assert isinstance(model.embed_tokens.table, Int4Linear) and model.embed_tokens.table.offset is None
    ckpt = GGUFCheckpoint(path)
    assert weight_bytes(o_proj) == ckpt.tensors["blk.0.attn_output.weight"].data.nbytes
    assert weight_bytes(model) <= 1.01 * ckpt.tensor_bytes()


def test_q5_0_is_held_at_its_file_size(gguf_model):
    """Q5_0 matrices as symmetric 5-bit values (no offsets: each weight d * (q - 16)) with the file's float16 d: 22
    bytes a group of 32, as the file's blocks; the tied table too; float32 logits equal transformers' on gguf's
    dequantised weights."""
    path, ref = gguf_model("q5_0", {}, T.Q5_0)
    model = load_model(path, load_config(path), torch.bfloat16, torch.device("cpu"))
    o_proj = model.layers[0].self_attn.o_proj
    assert isinstance(o_proj, Int8GroupLinear) and o_proj.offset is None and o_proj.scale.dtype == torch.float16
    assert o_proj.weight.dtype == torch.uint8  # (5 bits a value)
    assert isinstance(model.embed_tokens.table, Int8GroupLinear) and model.embed_tokens.table.offset is None
    ckpt = GGUFCheckpoint(path)
    assert weight_bytes(o_proj) == ckpt.tensors["blk.0.attn_output.weight"].data.nbytes
    assert weight_bytes(model) <= 1.01 * ckpt.tensor_bytes()
    exact = load_model(path, load_config(path), torch.float32, torch.device("cpu"))
    with torch.no_grad():
        theirs = hf_model(ref, torch.float32)(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(prompt_logits(exact, PROMPT), theirs, atol=2e-4, rtol=1e-4)

def test_moe_gguf_equals_transformers(gguf_model):
    """A Qwen3-MoE GGUF (stacked ffn_*_exps tensors, the router ffn_gate_inp in F32)."""
    path, ref = gguf_model("moe", {"ffn_down_exps.weight": T.Q8_0}, T.Q4_K, **{
        **json.loads(json.dumps(_moe())), "hidden_size": 256})
    model = load_model(path, load_config(path), torch.float32, torch.device("cpu"))
    assert model.config.is_moe and model.config.num_experts == 8
    with torch.no_grad():
        theirs = hf_model(ref, torch.float32)(torch.tensor([PROMPT])).logits[0]
    ours = prompt_logits(model, PROMPT)
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)


def _moe() -> dict:
    from nanoqwen.model_loader.init_random import preset_config

    raw = preset_config("qwen3-moe-tiny")
    return {k: raw[k] for k in ("architectures", "model_type", "num_experts", "num_experts_per_tok", "norm_topk_prob",
                                "decoder_sparse_step", "mlp_only_layers", "num_hidden_layers")} | {
        "moe_intermediate_size": 256}


def test_tokenizer_and_chat_template_from_metadata(gguf_model):
    """Token ids equal those of Qwen's tokenizer.json; the chat prompt (thinking, tools) equals the folder's."""
    path, _ = gguf_model("q4_k_m", Q4_K_M, T.Q4_K)
    ours, official = load_tokenizer(path), Tokenizer.from_pretrained(ASSETS / "qwen3-0.6b")
    texts = ["Hello, world!", "  leading spaces\n\nand\ttabs  ", "数学题：1+1=？ Ünïcödé ✓ 🙂",
             "<|im_start|>user\nhi<|im_end|>", "<think>\nhm\n</think>\n\n<tool_call>{}</tool_call>",
             "def f(x):\n    return x ** 2  # comment\r\n", "I'm, you're, we'll, they'd 123456789"]
    for text in texts:
        assert ours.encode(text) == official.encode(text), text
        assert ours.decode(official.encode(text)) == text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    for kwargs in ({}, {"enable_thinking": False}, {"tools": tools}):
        assert ours.apply_chat_template(messages, add_generation_prompt=True, **kwargs) == \
            official.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
    assert ours.eos_token == "<|im_end|>" and ours.pad_token == "<|endoftext|>"


@pytest.mark.parametrize("name,types,default", [
    ("q4_k_m", Q4_K_M, T.Q4_K),
    ("q5_k_m", Q5_K_M, T.Q5_K),
    ("int4-table", {"token_embd.weight": T.Q4_0, "attn_v.weight": T.Q5_1, "ffn_down.weight": T.Q5_0}, T.Q8_0),
], ids=["q4_k_m", "q5_k_m", "int4-table"])
def test_llm_runs_the_file_alone(gguf_model, tmp_path, name, types, default):
    """LLM(file.gguf): stop tokens and sampling defaults from the metadata; the fused CPU decode step (quantised
    embedding rows from a grouped int8 or an int4 table, int4 with float32 scales, grouped int8 with and without
    offsets) gives the tokens the plain path gives; a folder holding one .gguf is that file."""
    path, _ = gguf_model(name, types, default)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(str(path), max_model_len=128, kv_cache_memory=32 << 20)
    engine = llm.llm_engine
    assert engine.eos_token_ids == {151645, 151643}
    assert (engine.generation_config.top_k, engine.generation_config.temperature) == (20, pytest.approx(0.6))
    assert engine.runner.fused_decoder is not None
    fused = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    os.environ["NANOQWEN_FUSED_DECODE"] = "0"
    try:
        plain_llm = LLM(str(path), max_model_len=128, kv_cache_memory=32 << 20)
        assert plain_llm.llm_engine.runner.fused_decoder is None
        plain = plain_llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        del os.environ["NANOQWEN_FUSED_DECODE"]
    assert fused == plain and len(fused) == 16
    folder = tmp_path / "only-gguf"
    folder.mkdir()
    shutil.copy(path, folder / "qwen3-q4_k_m.gguf")
    assert resolve_model_path(str(folder)) == folder / "qwen3-q4_k_m.gguf"
    assert resolve_model_path(str(folder), "qwen3-q4_k_m.gguf") == folder / "qwen3-q4_k_m.gguf"


def test_cli_generate_with_a_gguf(gguf_model):
    path, _ = gguf_model("q4_k_m", Q4_K_M, T.Q4_K)
    r = run_cli("generate", "--model", str(path), "--prompt", "Hello", "--max-tokens", "4", "--temperature", "0",
                "--kv-cache-memory", "32MiB", "--max-model-len", "128")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()


def test_errors_name_the_problem(gguf_model, tmp_path):
    path, _ = gguf_model("q4_k_m", Q4_K_M, T.Q4_K)
    with pytest.raises(ConfigError, match="already quantized .*Q4_K.*leave out --quantization int8"):
        LLM(str(path), quantization="int8", max_model_len=128, kv_cache_memory=32 << 20)
    with pytest.raises(ConfigError, match="is a GGUF file, not quantized with AWQ"):
        LLM(str(path), quantization="awq", max_model_len=128, kv_cache_memory=32 << 20)
    # an unsupported type names the tensor, its type and the supported list
    raw = bytearray(path.read_bytes())
    ckpt = GGUFCheckpoint(path)
    bad = tmp_path / "iq4.gguf"
    _retype(raw, ckpt, "blk.0.attn_output.weight", 23)  # IQ4_XS
    bad.write_bytes(bytes(raw))
    with pytest.raises(WeightsError, match=r"'blk\.0\.attn_output\.weight' has type IQ4_XS.*supported types: F32"):
        load_model(bad, load_config(bad), torch.float32, torch.device("cpu"))
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[: 1 << 20])
    with pytest.raises(WeightsError, match="truncated.gguf is not a readable GGUF file"):
        load_config(truncated)
    with pytest.raises(Exception, match="holds 2 GGUF files"):
        folder = tmp_path / "two"
        folder.mkdir()
        for name in ("a.gguf", "b.gguf"):
            shutil.copy(path, folder / name)
        resolve_model_path(str(folder))


def _retype(raw: bytearray, ckpt: GGUFCheckpoint, name: str, new_type: int) -> None:
    """Rewrite tensor `name`'s type id in the file's tensor infos (its data stays: only the type is checked)."""
    key = name.encode()
    at = bytes(raw).index(len(key).to_bytes(8, "little") + key) + 8 + len(key)
    dims = int.from_bytes(raw[at: at + 4], "little")
    at += 4 + 8 * dims
    raw[at: at + 4] = new_type.to_bytes(4, "little")


def ollama_store(root: Path, gguf_path: Path, registry: str = "registry.ollama.ai", name: str = "library/qwen3",
                 tag: str = "0.6b") -> Path:
    """An Ollama models folder holding one pulled model as Ollama lays it out: the GGUF as a blob named by its
    digest, beside template and params blobs, and the manifest that names them. -> the manifest's path."""
    import hashlib

    blobs = root / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    layers = []
    for media_type, data in (("application/vnd.ollama.image.model", gguf_path.read_bytes()),
                             ("application/vnd.ollama.image.template", b"{{ .Prompt }}"),
                             ("application/vnd.ollama.image.params", b'{"temperature": 0.6}')):
        digest = hashlib.sha256(data).hexdigest()
        (blobs / f"sha256-{digest}").write_bytes(data)
        layers.append({"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(data)})
    manifest = root / "manifests" / registry / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2"
                                    "+json", "config": layers[-1], "layers": layers}))
    return manifest


def test_a_model_ollama_pulled_runs_by_its_name_or_manifest(gguf_model, tmp_path, monkeypatch):
    """`--model qwen3:0.6b` (Ollama's name) and the manifest's path load the GGUF blob the manifest names: the same
    tokens as the .gguf file itself."""
    path, _ = gguf_model("q4_k_m", Q4_K_M, T.Q4_K)
    manifest = ollama_store(tmp_path / "models", path)
    ollama_store(tmp_path / "models", path, registry="ollama.com", name="library/qwen3", tag="latest")
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "models"))
    blob = resolve_model_path("qwen3:0.6b")
    assert blob.parent == tmp_path / "models" / "blobs" and blob.read_bytes() == path.read_bytes()
    assert resolve_model_path(str(manifest)) == blob
    assert resolve_model_path("qwen3") == resolve_model_path("library/qwen3:latest") == blob  # "latest"
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = LLM(str(path), max_model_len=128, kv_cache_memory=32 << 20).generate([PROMPT], params, use_tqdm=False)
    got = LLM("qwen3:0.6b", max_model_len=128, kv_cache_memory=32 << 20).generate([PROMPT], params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    with pytest.raises(ModelNotFoundError, match=r"qwen3:32b: no Ollama model of that name in .*models.*ollama pull"):
        resolve_model_path("qwen3:32b")
    (tmp_path / "models" / "blobs" / blob.name).unlink()
    with pytest.raises(ModelNotFoundError, match="its weights blob sha256:[0-9a-f]+ is not in the store"):
        resolve_model_path(str(manifest))


# K-quant super-blocks hold 256 inputs: a rank's share of o_proj's and down_proj's inputs must be whole ones
TP_SHAPE = {"num_attention_heads": 8}  # o_proj 512 inputs, down_proj 512: 256 a rank


@pytest.mark.parametrize("name,types,default,overrides", [
    ("tp-q4_k_m", Q4_K_M, T.Q4_K, TP_SHAPE),
    ("tp-mixed", MIXED, T.Q4_K, {**TP_SHAPE, "untied": True, "tie_word_embeddings": False}),
    ("tp-moe", {"ffn_down_exps.weight": T.Q8_0}, T.Q4_K, {**_moe(), **TP_SHAPE}),
    ("tp-f16", {"token_embd.weight": T.F16}, T.F16, TP_SHAPE),
], ids=["q4_k_m", "every-type-untied", "moe", "f16"])
def test_tensor_parallel_ranks_hold_their_share_of_the_file(gguf_model, name, types, default, overrides):
    """tensor_parallel_size 2: each rank holds its half of every matrix as the file holds it: the output rows of each
    part of qkv_proj and gate_up_proj (each expert's gate and up), of the LM head and of the embedding table (a
    quantised one looked up as VocabParallelEmbedding is), the input columns of o_proj and down_proj; each exactly
    that slice of the whole matrix."""
    path, _ = gguf_model(name, types, default, **overrides)
    config = load_config(path)
    cpu = torch.device("cpu")
    whole = load_model(path, config, torch.float32, cpu)
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    vocab, hidden = config.vocab_size, config.hidden_size
    for rank in range(2):
        shard = load_model(path, config, torch.float32, cpu, tp_rank=rank, tp_size=2)
        assert shard.is_tied == whole.is_tied
        table = matrix_of(whole.lm_head, hidden)
        assert torch.equal(matrix_of(shard.lm_head, hidden), table.chunk(2)[rank])
        if isinstance(whole.embed_tokens, QuantizedEmbedding):
            assert shard.embed_tokens.vocab_start == rank * vocab // 2 and shard.embed_tokens.tp_size == 2
            rows = torch.arange(vocab // 2)
            assert torch.equal(shard.embed_tokens.lookup(rows), whole.embed_tokens.lookup(rows + rank * vocab // 2))
        else:
            assert torch.equal(shard.embed_tokens.weight, whole.embed_tokens.weight.chunk(2)[rank])
        for full, part in zip(whole.layers, shard.layers, strict=True):
            # module: (its inputs, its parts' rows to cut, or None: cut the inputs)
            cuts = {"self_attn.qkv_proj": (hidden, [q, kv, kv]), "self_attn.o_proj": (q, None)}
            if hasattr(full.mlp, "experts"):
                for e in range(config.num_experts):
                    gate_up = matrix_of(full.mlp.experts, hidden, ("gate_up_proj", e))
                    inter = gate_up.shape[0] // 2
                    assert torch.equal(matrix_of(part.mlp.experts, hidden, ("gate_up_proj", e)),
                                       rank_rows(gate_up, [inter, inter], rank))
                    assert torch.equal(matrix_of(part.mlp.experts, inter // 2, ("down_proj", e)),
                                       matrix_of(full.mlp.experts, inter, ("down_proj", e)).chunk(2, 1)[rank])
                assert torch.equal(part.mlp.gate.weight, full.mlp.gate.weight)  # the router: whole
            else:
                inter = config.intermediate_size
                cuts |= {"mlp.gate_up_proj": (hidden, [inter, inter]), "mlp.down_proj": (inter, None)}
            for module, (inputs, sizes) in cuts.items():
                a, b = full.get_submodule(module), part.get_submodule(module)
                w = matrix_of(a, inputs)
                want = rank_rows(w, sizes, rank) if sizes else w.chunk(2, 1)[rank]
                assert torch.equal(matrix_of(b, want.shape[1]), want), (name, module, rank)


def test_tensor_parallel_cuts_through_super_blocks_with_one_level_of_scales(gguf_model, tmp_path):
    """o_proj's 256 inputs cut in two are 128 a rank, half a Q4_K super-block of 256: that share keeps the same
    scales as one level (float32, exact: the slice of the whole matrix), while down_proj's Q6_K share (256 a rank)
    stays two-level at 6 bits. A cut inside a group of 32 is a ConfigError naming the tensor and the fix."""
    path, _ = gguf_model("q4_k_m", Q4_K_M, T.Q4_K)
    config = load_config(path)
    whole = load_model(path, config, torch.float32, torch.device("cpu"))
    shard = load_model(path, config, torch.float32, torch.device("cpu"), tp_rank=1, tp_size=2)
    o_proj, down_proj = shard.layers[0].self_attn.o_proj, shard.layers[0].mlp.down_proj
    assert isinstance(o_proj, Int4Linear) and o_proj.scale.dtype == torch.float32 and o_proj.super_scale is None
    assert torch.equal(matrix_of(o_proj, 128), matrix_of(whole.layers[0].self_attn.o_proj, 256).chunk(2, 1)[1])
    assert isinstance(down_proj, Int8GroupLinear) and down_proj.super_scale is not None
    assert down_proj.weight.dtype == torch.uint8  # (6 bits a value)
    odd, _ = write_gguf(tmp_path, tiny_config(**{**SHAPE, "intermediate_size": 96}), {}, T.Q8_0)  # 48 a rank
    with pytest.raises(ConfigError, match=r"blk\.0\.ffn_down\.weight: tensor_parallel_size 2 cuts its 96 inputs "
                                          r"into 48 a rank.*boundary of 32.*use a tensor_parallel_size"):
        load_model(odd, load_config(odd), torch.float32, torch.device("cpu"), tp_rank=0, tp_size=2)
