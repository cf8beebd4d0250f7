"""GGUF files for the tests, written with the `gguf` package's writer as llama.cpp's convert_hf_to_gguf.py lays
out Qwen3 and Qwen3-MoE: metadata keys, tensor names, tokenizer fields (tokens, token types, merges, the qwen2
pre-tokenizer, special ids, chat template). Quantised tensors are random blocks of their type (scales set so the
weights have a given spread), so every type is covered whether or not a quantiser exists for it; beside each file,
a safetensors folder with the same weights dequantised by `gguf.quants.dequantize` (float32), which transformers
loads as the reference."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from safetensors.torch import save_file

from nanoqwen.config.model import Qwen3Config
from nanoqwen.model_loader.init_random import ASSETS, checkpoint_shapes

# the float16 fields of each type's block (byte offsets), and the base value of its scales for a weight spread
# of about 0.08 (the q spread of random bytes worked out per type)
SCALE_FIELDS = {T.Q8_0: [0], T.Q4_0: [0], T.Q4_1: [0], T.Q5_0: [0], T.Q5_1: [0], T.Q4_K: [0], T.Q5_K: [0],
                T.Q6_K: [208]}
MIN_FIELDS = {T.Q4_1: 2, T.Q5_1: 2, T.Q4_K: 2, T.Q5_K: 2}  # m (Q4_1, Q5_1) or dmin (K types)
SCALE_BASE = {T.Q8_0: 0.08 / 74, T.Q4_0: 0.08 / 4.6, T.Q4_1: 0.08 / 4.6, T.Q5_0: 0.08 / 9.2, T.Q5_1: 0.08 / 9.2,
              T.Q4_K: 0.08 / 240, T.Q5_K: 0.08 / 490, T.Q6_K: 0.08 / 1369}
MIN_OVER_SCALE = {T.Q4_1: -7.5, T.Q5_1: -15.5, T.Q4_K: 7.5, T.Q5_K: 15.5}  # centres the weights
HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp"}


def random_blocks(rng: np.random.Generator, qtype: T, rows: int, cols: int) -> np.ndarray:
    """Random blocks of a quantised type [rows, row bytes] with sane float16 scales."""
    weights, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // weights, nbytes), dtype=np.uint8)
    d = (SCALE_BASE[qtype] * rng.uniform(0.5, 1.5, size=(rows, cols // weights))).astype(np.float16)
    for at in SCALE_FIELDS[qtype]:
        raw[..., at:at + 2] = d[..., None].view(np.uint8)
    if qtype in MIN_FIELDS:
        m = (d.astype(np.float32) * MIN_OVER_SCALE[qtype]).astype(np.float16)
        raw[..., MIN_FIELDS[qtype]:MIN_FIELDS[qtype] + 2] = m[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def tokenizer_fields(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    """The tokenizer as convert_hf_to_gguf.py writes Qwen's: tokens padded to vocab_size with UNUSED [PADn]
    entries, added tokens CONTROL (special, or looking special: <|...|>) or USER_DEFINED."""
    spec = json.loads((ASSETS / "qwen3-0.6b" / "tokenizer.json").read_text(encoding="utf-8"))
    config = json.loads((ASSETS / "qwen3-0.6b" / "tokenizer_config.json").read_text(encoding="utf-8"))
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    for token, i in spec["model"]["vocab"].items():
        tokens[i], types[i] = token, gguf.TokenType.NORMAL
    for added in spec["added_tokens"]:
        content = added["content"]
        special = added["special"] or (content.startswith("<|") and content.endswith("|>"))
        tokens[added["id"]] = content
        types[added["id"]] = gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    ids = {t["content"]: t["id"] for t in spec["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(ids[config["eos_token"]])
    writer.add_pad_token_id(ids[config["pad_token"]])
    writer.add_bos_token_id(ids["<|endoftext|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(config["chat_template"])


def write_gguf(out: Path, raw_config: dict, types: dict[str, T], default: T = T.F32, seed: int = 0,
               float_std: float = 0.08) -> tuple[Path, Path]:
    """(the GGUF file, a safetensors folder of its weights dequantised) for a random model of raw_config.

    types: GGUF tensor name suffix (e.g. "attn_v.weight", "token_embd.weight") -> its type; other matrices get
    `default`; norms are F32, as the converter writes them.
    """
    rng = np.random.default_rng(seed)
    config = Qwen3Config.from_dict(raw_config)
    arch = "qwen3moe" if config.is_moe else "qwen3"
    out.mkdir(parents=True, exist_ok=True)
    path = out / "model.gguf"
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if config.is_moe:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_float32("general.sampling.temp", 0.6)
    writer.add_int32("general.sampling.top_k", 20)
    writer.add_float32("general.sampling.top_p", 0.95)
    tokenizer_fields(writer, config.vocab_size)
    reference: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], list[tuple[int, np.ndarray]]] = {}

    def gguf_name(hf: str) -> str:
        if hf == "model.embed_tokens.weight":
            return "token_embd.weight"
        if hf == "model.norm.weight":
            return "output_norm.weight"
        if hf == "lm_head.weight":
            return "output.weight"
        _, _, i, rest = hf.split(".", 3)
        module, _, leaf = rest.rpartition(".")
        return f"blk.{i}.{HF_TO_GGUF[module]}.{leaf}"

    def add(name: str, shape: tuple[int, ...]) -> np.ndarray:
        """Write tensor `name` [rows, cols] of its type; return its float32 values."""
        qtype = next((t for suffix, t in types.items() if name.endswith(suffix)), default)
        if len(shape) == 1 or name.endswith("_norm.weight") or "ffn_gate_inp" in name and qtype not in (
                T.F32, T.F16, T.BF16):
            qtype = T.F32
        if qtype in (T.F32, T.F16, T.BF16):
            values = rng.normal(0, float_std if len(shape) > 1 else 0.1, size=shape).astype(np.float32)
            if len(shape) == 1:
                values += 1.0  # norm weights near 1
            if qtype == T.F16:
                values = values.astype(np.float16).astype(np.float32)
                writer.add_tensor(name, values.astype(np.float16))
            elif qtype == T.BF16:
                bits = torch.from_numpy(values).to(torch.bfloat16)
                values = bits.float().numpy()
                writer.add_tensor(name, bits.view(torch.int16).numpy().view(np.uint16), raw_dtype=T.BF16)
            else:
                writer.add_tensor(name, values)
            return values
        rows = int(np.prod(shape[:-1]))
        blocks = random_blocks(rng, qtype, rows, shape[-1])
        byte_shape = (*shape[:-1], blocks.shape[-1])
        writer.add_tensor(name, blocks.reshape(byte_shape), raw_dtype=qtype)
        return gguf.quants.dequantize(blocks, qtype).reshape(shape).astype(np.float32)

    for hf, shape in checkpoint_shapes(config):
        if ".experts." in hf:  # model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight: stacked below
            parts = hf.split(".")
            experts.setdefault((int(parts[2]), parts[6]), []).append((int(parts[5]), shape))
            continue
        if hf == "lm_head.weight" and config.tie_word_embeddings:
            continue
        values = add(gguf_name(hf), shape)
        reference[hf] = torch.from_numpy(values)
    for (i, proj), items in sorted(experts.items()):
        stacked_shape = (len(items), *items[0][1])
        kind = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}[proj]
        values = add(f"blk.{i}.ffn_{kind}_exps.weight", stacked_shape)
        for j in range(len(items)):
            reference[f"model.layers.{i}.mlp.experts.{j}.{proj}.weight"] = torch.from_numpy(values[j].copy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ref = out / "dequantized"
    ref.mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in reference.items()}, ref / "model.safetensors")
    (ref / "config.json").write_text(json.dumps({**raw_config, "torch_dtype": "float32"}, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS / "qwen3-0.6b" / name, ref / name)
    return path, ref
