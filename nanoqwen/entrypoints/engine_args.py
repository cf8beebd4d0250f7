"""The engine's command-line flags: every EngineConfig field as a flag (as vLLM's EngineArgs adds
them), shared by `nanoqwen generate|chat|embed|rerank|serve`, and read back into an EngineConfig."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields

from nanoqwen.config.cache import KV_CACHE_DTYPES
from nanoqwen.config.engine import EngineConfig
from nanoqwen.config.model import DTYPE_NAMES
from nanoqwen.config.quantization import CHECKPOINT_METHODS, QUANTIZATION_METHODS


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The command-line flags of every EngineConfig field (read back by engine_config_from_args)."""
    default = EngineConfig()
    p.add_argument("--model", default=default.model,
                   help="model folder, GGUF file (or a folder holding one), or Hugging Face hub id "
                        f"(default: {default.model})")
    p.add_argument("--gguf-file", default=None, metavar="NAME",
                   help="with a hub id for --model: the GGUF file of that repo to load, e.g. Qwen3-8B-Q4_K_M.gguf")
    p.add_argument("--dtype", choices=["auto", *DTYPE_NAMES], default="auto",
                   help="weights and activations dtype "
                        "(auto: the checkpoint's on GPU, bfloat16 on CPU)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="default: cuda when available")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + answer in tokens "
                        "(default: the model's max_position_embeddings)")
    p.add_argument("--max-num-seqs", type=int, default=default.max_num_seqs,
                   help="most sequences per step")
    p.add_argument("--max-num-batched-tokens", type=int, default=default.max_num_batched_tokens,
                   help="most tokens per step")
    p.add_argument("--kv-cache-memory", type=memory_size, default=None,
                   help="KV cache size: bytes (e.g. 2GiB) or a fraction of free memory (e.g. 0.5)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=default.kv_cache_dtype,
                   help="how the KV cache stores keys and values: auto (the model's dtype), int8, fp8 "
                        "(fp8_e4m3) or fp8_e5m2 (about half the bytes a token: twice the tokens in the same memory)")
    p.add_argument("--block-size", type=int, default=default.block_size,
                   help="tokens per KV-cache block")
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false", help="turn prefix caching off")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no torch.compile (CPU) and no CUDA graphs (GPU): "
                        "faster start-up, slower steps")
    p.add_argument("--num-scheduler-steps", type=int, default=default.num_scheduler_steps, metavar="K",
                   help="greedy decode batches (no logprobs, penalties or grammar) run up to K "
                        "steps in one go: less overhead per token, tokens arrive K at a time "
                        "(default 1)")
    p.add_argument("--task", choices=["auto", "generate", "embed", "score"], default="auto",
                   help="what the model is for: generate text, embed (Qwen3-Embedding) or score "
                        "(Qwen3-Reranker); auto reads it from the checkpoint's files")
    p.add_argument("--max-seqs-per-request-step", type=int, default=default.max_seqs_per_request_step, metavar="N",
                   help="most answers of one request (its n) that decode in one step; the others take turns, "
                        f"so others' tokens wait for short steps only (default {default.max_seqs_per_request_step})")
    p.add_argument("--max-stop-sequences", type=int, default=default.max_stop_sequences, metavar="N",
                   help=f"most stop strings one request may give (default {default.max_stop_sequences})")
    p.add_argument("--max-stop-token-ids", type=int, default=default.max_stop_token_ids, metavar="N",
                   help=f"most stop token ids one request may give (default {default.max_stop_token_ids})")
    p.add_argument("--enable-lora", action="store_true",
                   help="run LoRA adapters (PEFT's format) over the model: requests choose one (docs/lora.md)")
    p.add_argument("--max-loras", type=int, default=default.max_loras, metavar="N",
                   help=f"LoRA adapters that run in one step (device slots; default {default.max_loras})")
    p.add_argument("--max-lora-rank", type=int, default=default.max_lora_rank, metavar="R",
                   help=f"the largest LoRA rank an adapter may have (default {default.max_lora_rank})")
    add_parallel_and_quantization_args(p)


def add_parallel_and_quantization_args(p: argparse.ArgumentParser) -> None:
    """--tensor-parallel-size and --quantization (also on `nanoqwen bench`, whose other flags are
    its own)."""

    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="split the model over N processes (N GPUs, or CPU processes); "
                        "nanoqwen starts them, "
                        "or run under `torchrun --nproc-per-node N` (default 1)")
    p.add_argument("--quantization", choices=[*QUANTIZATION_METHODS, *CHECKPOINT_METHODS], default=None,
                   help="weight-only quantisation made at load time: int8 (about half the "
                        "weight bytes) or int4 (group-wise, about 0.28 of them); faster decode "
                        "on CPU. awq, gptq, fp8, gguf: the checkpoint's own (already quantised; "
                        "the default for such a checkpoint)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as vLLM\'s: e.g. \'{"method": "self_quantized", '
                        '"quantization": "int4", "num_speculative_tokens": 4}\', '
                        '\'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 3}\' or \'{"method": "draft_model", '
                        '"model": "Qwen/Qwen3-0.6B", "num_speculative_tokens": 4}\'')


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of parsed command-line flags (the fields add_engine_args defines)."""
    given = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
    return EngineConfig(**given)


_UNITS = {"": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10,
          "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def memory_size(text: str) -> int | float:
    """--kv-cache-memory: bytes ("67108864", "64MiB", "4G") or a fraction of free memory ("0.5")."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (bytes, e.g. 64MiB) "
                                         "or a fraction (e.g. 0.5)")
    number, unit = m.group(1), m.group(2).lower()
    if "." in number and not unit:
        return float(number)
    return int(float(number) * _UNITS[unit])
