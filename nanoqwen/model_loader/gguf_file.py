"""A GGUF file (llama.cpp's format, as its convert_hf_to_gguf.py writes Qwen3 and Qwen3-MoE) read: its config,
generation defaults and tokenizer from the file's metadata, its tensors as the file holds them (gguf.py puts them
into the model).

Read here, from a memory map, as the GGUF specification lays the file out (the `gguf` package, llama.cpp's own
Python reader, parses the 150k-entry token arrays item by item, seconds per open; the tests check this reader
against it). What comes from where:

- Config: `general.architecture` qwen3 or qwen3moe; `{arch}.block_count`, `.embedding_length`,
  `.feed_forward_length`, `.attention.head_count`, `.attention.head_count_kv`, `.attention.key_length`,
  `.context_length`, `.rope.freq_base`, `.attention.layer_norm_rms_epsilon`, `.rope.scaling.*` (yarn), and for
  MoE `.expert_count`, `.expert_used_count`, `.expert_feed_forward_length` (the router's top-k weights
  normalised, as llama.cpp's qwen3moe graph does). The vocabulary size is token_embd's row count; the LM head is
  tied when the file has no `output.weight`.
- Tokenizer: `tokenizer.ggml.tokens` / `.merges` / `.token_type` with the `qwen2` pre-tokenizer, rebuilt as the
  byte-level BPE of Qwen's tokenizer.json (normal tokens the BPE vocabulary; CONTROL tokens special added tokens;
  USER_DEFINED ones, such as <think> and <tool_call>, added tokens that are not special; UNUSED padding
  entries dropped). Token ids equal tokenizer.json's (tests/model_loader/test_gguf.py). The converter marks a
  few of Qwen's non-special added tokens as CONTROL (<|fim_prefix|> and the other fill-in-the-middle ones), so
  `skip_special_tokens` hides those too. The chat template is `tokenizer.chat_template`.
- Stop tokens: `tokenizer.ggml.eos_token_id` and `.eot_token_id`, plus <|im_end|> and <|endoftext|> where the
  vocabulary has them (llama.cpp's end-of-generation rule; Qwen's generation_config.json names the same two).
- Sampling defaults: `general.sampling.temp`, `.top_k`, `.top_p`, `.min_p` where the converter wrote them.
- Tensors (gguf.py puts them in the model): float ones (F32, F16, BF16) go into the model's parameters in the
  model dtype; quantised ones keep their values in nanoqwen's formats (nanoqwen/quantization/prequantized.py), never
  quantised a second time. Any other type is an error naming the tensor, its type and the supported ones.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
import torch

from nanoqwen.config.model import GenerationConfig, Qwen3Config
from nanoqwen.errors import ConfigError, WeightsError
from nanoqwen.ops.gguf_quants import BLOCK_SIZES, FLOAT_TYPES, SUPPORTED_TYPES, GGMLType, GroupedWeights, unpack
from nanoqwen.tokenizer import Tokenizer

ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
# the token types of tokenizer.ggml.token_type (llama.cpp's llama_token_type)
NORMAL, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 3, 4, 5, 6
# Qwen2/Qwen3's pre-tokenizer split (tokenizer.ggml.pre "qwen2"), as in Qwen's tokenizer.json
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
END_OF_GENERATION = ("<|im_end|>", "<|endoftext|>")
# every ggml type by id (ggml.h's enum ggml_type), so an error names one nanoqwen does not read
GGML_TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K",
                   11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS",
                   18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8",
                   25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0",
                   39: "MXFP4"}


def is_gguf(path: Path) -> bool:
    """A GGUF file: named *.gguf, or (as Ollama's blobs, named by their digest) starting with GGUF's magic."""
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


@dataclass
class GGUFTensor:
    """One tensor of the file: its type and its data as the file holds it (a read-only memory map)."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]  # in torch's order: [rows, cols] ([E, rows, cols] for experts)
    data: np.ndarray  # uint8, the tensor's bytes

    def rows(self) -> torch.Tensor:
        """The data copied out of the map: the values of a float type, else uint8 [..., row bytes]."""
        t = GGMLType(self.ggml_type)
        raw = torch.from_numpy(np.array(self.data))  # (a copy: the map is read-only)
        if t == GGMLType.BF16:
            return raw.view(torch.bfloat16).reshape(self.shape)
        if t == GGMLType.F16:
            return raw.view(torch.float16).reshape(self.shape)
        if t == GGMLType.F32:
            return raw.view(torch.float32).reshape(self.shape)
        return raw.reshape(*self.shape[:-1], -1)


# GGUF's metadata value types: id -> struct format (the fixed-size ones), or "string" / "array"
VALUE_TYPES: dict[int, str] = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                               8: "string", 9: "array", 10: "<Q", 11: "<q", 12: "<d"}
# bytes per element of the float types, and of one block of the quantised ones (weights, bytes)
TYPE_BYTES = {GGMLType.F32: (1, 4), GGMLType.F16: (1, 2), GGMLType.BF16: (1, 2), **BLOCK_SIZES}


class _Cursor:
    """Reads GGUF's little-endian values from the file's bytes, front to back."""

    def __init__(self, data: memoryview) -> None:
        self.data, self.at = data, 0

    def number(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.data, self.at)[0]
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.number("<Q")
        if self.at + n > len(self.data):
            raise ValueError("the file ends inside its header (truncated)")
        text = str(self.data[self.at: self.at + n], "utf-8", errors="replace")
        self.at += n
        return text

    def value(self, kind: int) -> Any:
        fmt = VALUE_TYPES.get(kind)
        if fmt is None:
            raise ValueError(f"unknown metadata value type {kind}")
        if fmt == "string":
            return self.string()
        if fmt != "array":
            return self.number(fmt)
        item, count = self.number("<I"), self.number("<Q")
        item_fmt = VALUE_TYPES.get(item)
        if item_fmt in ("string", "array", None):
            return [self.value(item) for _ in range(count)]
        values = list(struct.unpack_from(f"<{count}{item_fmt[1]}", self.data, self.at))
        self.at += count * struct.calcsize(item_fmt)
        return values


class GGUFCheckpoint:
    """A GGUF file's metadata and tensors (memory-mapped until close()). Read as the GGUF specification lays it
    out (llama.cpp's docs/gguf.md): magic, version, counts, the metadata key-value pairs, the tensor infos, then
    the tensors' data at the file's alignment."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fields: dict[str, Any] = {}
        self.tensors: dict[str, GGUFTensor] = {}
        try:
            self._map = np.memmap(path, dtype=np.uint8, mode="r")
            self._read()
        except (ValueError, OSError, OverflowError, struct.error) as e:
            raise WeightsError(f"{path} is not a readable GGUF file ({e}); re-download it") from None
        self.arch = str(self.field("general.architecture"))
        if self.arch not in ARCHITECTURES:
            raise ConfigError(f"{path}: GGUF architecture {self.arch!r} is not supported; nanoqwen runs "
                              f"{', '.join(ARCHITECTURES)} (Qwen3 and Qwen3-MoE)")

    def _read(self) -> None:
        c = _Cursor(memoryview(self._map))
        if bytes(c.data[:4]) != b"GGUF":
            raise ValueError("it does not start with the GGUF magic")
        c.at = 4
        version = c.number("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (nanoqwen reads versions 2 and 3)")
        tensor_count, kv_count = c.number("<Q"), c.number("<Q")
        for _ in range(kv_count):
            key = c.string()
            self.fields[key] = c.value(c.number("<I"))
        infos = []
        for _ in range(tensor_count):
            name = c.string()
            dims = [c.number("<Q") for _ in range(c.number("<I"))]
            infos.append((name, dims, c.number("<I"), c.number("<Q")))
        alignment = int(self.fields.get("general.alignment", 32))
        start = -(-c.at // alignment) * alignment
        for name, dims, kind, offset in infos:
            shape = tuple(int(n) for n in reversed(dims)) or (1,)
            weights, nbytes = TYPE_BYTES.get(kind, (1, 0))  # (an unsupported type: no data read; checked() says)
            size = int(np.prod(shape)) // weights * nbytes
            if start + offset + size > len(self._map):
                raise ValueError(f"tensor {name!r} runs past the end of the file (truncated)")
            self.tensors[name] = GGUFTensor(name, kind, shape, self._map[start + offset: start + offset + size])

    def close(self) -> None:
        """Drop the memory map (its pages count as this process's memory while it is open)."""
        self.tensors.clear()
        self._map = None

    def field(self, key: str, default: Any = ...) -> Any:
        if key not in self.fields:
            if default is ...:
                raise ConfigError(f"{self.path}: GGUF metadata key {key!r} is missing")
            return default
        return self.fields[key]

    def arch_field(self, key: str, default: Any = ...) -> Any:
        return self.field(f"{self.arch}.{key}", default)

    def tensor_bytes(self) -> int:
        return sum(int(t.data.nbytes) for t in self.tensors.values())

    # ---- the config and the generation defaults

    def config(self) -> Qwen3Config:
        heads = int(self.arch_field("attention.head_count"))
        hidden = int(self.arch_field("embedding_length"))
        embed = self.tensors.get("token_embd.weight")
        if embed is None:
            raise WeightsError(f"{self.path}: tensor 'token_embd.weight' is missing")
        eos = self.stop_token_ids()
        raw: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.arch]],
            "vocab_size": embed.shape[0],
            "hidden_size": hidden,
            "intermediate_size": int(self.arch_field("feed_forward_length",
                                                     self.arch_field("expert_feed_forward_length", 0))),
            "num_hidden_layers": int(self.arch_field("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.arch_field("attention.head_count_kv", heads)),
            "head_dim": int(self.arch_field("attention.key_length", hidden // heads)),
            "max_position_embeddings": int(self.arch_field("context_length")),
            "rms_norm_eps": float(self.arch_field("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self.arch_field("rope.freq_base", 1_000_000.0)),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "torch_dtype": "bfloat16",
            "eos_token_id": eos,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id", None),
        }
        scaling = self.arch_field("rope.scaling.type", None)
        if scaling == "yarn":
            raw["rope_scaling"] = {
                "rope_type": "yarn", "factor": float(self.arch_field("rope.scaling.factor")),
                "original_max_position_embeddings": int(self.arch_field("rope.scaling.original_context_length"))}
        elif scaling not in (None, "none"):
            raise ConfigError(f"{self.path}: {self.arch}.rope.scaling.type {scaling!r} is not supported "
                              "(none or yarn)")
        if self.arch == "qwen3moe":
            raw.update(num_experts=int(self.arch_field("expert_count")),
                       num_experts_per_tok=int(self.arch_field("expert_used_count")),
                       moe_intermediate_size=int(self.arch_field("expert_feed_forward_length")),
                       norm_topk_prob=True, decoder_sparse_step=1,
                       # (llama.cpp's qwen3moe has none; a layer without a router here is a dense one)
                       mlp_only_layers=[i for i in range(raw["num_hidden_layers"])
                                        if f"blk.{i}.ffn_gate_inp.weight" not in self.tensors])
        return Qwen3Config.from_dict(raw, where=f"{self.path} (GGUF metadata)")

    def stop_token_ids(self) -> list[int]:
        ids = [self.field(f"tokenizer.ggml.{name}_token_id", None) for name in ("eos", "eot")]
        tokens = self.field("tokenizer.ggml.tokens", [])
        ids += [i for i, token in enumerate(tokens) if token in END_OF_GENERATION]
        return list(dict.fromkeys(int(i) for i in ids if i is not None))

    def generation_config(self) -> GenerationConfig:
        def number(key: str) -> Any:
            return self.field(f"general.sampling.{key}", None)

        top_k = number("top_k")
        return GenerationConfig(eos_token_id=self.stop_token_ids(), temperature=number("temp"),
                                top_k=None if top_k is None else int(top_k), top_p=number("top_p"),
                                min_p=number("min_p"))

    # ---- the tokenizer

    def tokenizer(self) -> Tokenizer:
        model = self.field("tokenizer.ggml.model")
        pre = self.field("tokenizer.ggml.pre", None)
        if model != "gpt2" or pre not in ("qwen2", None):
            raise ConfigError(f"{self.path}: tokenizer {model!r} with pre-tokenizer {pre!r} is not Qwen's; nanoqwen "
                              "reads tokenizer.ggml.model 'gpt2' with tokenizer.ggml.pre 'qwen2'")
        tokens = self.field("tokenizer.ggml.tokens")
        types = self.field("tokenizer.ggml.token_type", [NORMAL] * len(tokens))
        merges = self.field("tokenizer.ggml.merges")
        vocab = {t: i for i, (t, kind) in enumerate(zip(tokens, types, strict=True)) if kind in (NORMAL, BYTE)}
        added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                  "normalized": False, "special": kind == CONTROL}
                 for i, (t, kind) in enumerate(zip(tokens, types, strict=True)) if kind in (CONTROL, USER_DEFINED)]
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
        spec = {
            "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": {"type": "NFC"},
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated", "invert": False},
                byte_level]},
            "post_processor": byte_level, "decoder": byte_level,
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                      "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab, "merges": list(merges)},
        }
        backend = tokenizers.Tokenizer.from_str(json.dumps(spec))

        def token(key: str) -> str | None:
            i = self.field(f"tokenizer.ggml.{key}_token_id", None)
            return None if i is None or not 0 <= int(i) < len(tokens) else tokens[int(i)]

        add_bos = bool(self.field("tokenizer.ggml.add_bos_token", False))
        return Tokenizer(backend, bos_token=token("bos") if add_bos else None, eos_token=token("eos"),
                         pad_token=token("padding"), chat_template=self.field("tokenizer.chat_template", None),
                         origin=f"{self.path} (GGUF metadata)")

    # ---- the weights

    def checked(self, name: str) -> GGUFTensor:
        t = self.tensors[name]
        if t.ggml_type not in SUPPORTED_TYPES:
            supported = ", ".join(GGMLType(s).name for s in SUPPORTED_TYPES)
            raise WeightsError(f"{self.path}: tensor {name!r} has type {type_name(t.ggml_type)}, which nanoqwen does "
                               "not read; "
                               f"supported types: {supported} (re-quantise the model to one of them, e.g. with "
                               "llama.cpp's llama-quantize to Q4_K_M)")
        return t

    def matrix(self, name: str) -> torch.Tensor | GroupedWeights:
        """Tensor `name` as a float tensor (float types) or GroupedWeights (quantised types) [rows, cols]."""
        t = self.checked(name)
        if t.ggml_type in FLOAT_TYPES:
            return t.rows()
        rows = t.rows()
        return unpack(rows.reshape(-1, rows.shape[-1]), t.ggml_type, t.shape[-1])


def type_name(ggml_type: int) -> str:
    """A ggml type's name (llama.cpp's ggml_type enum), for errors."""
    return GGML_TYPE_NAMES.get(ggml_type, f"ggml type {ggml_type}")


