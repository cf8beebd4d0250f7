"""Throughput benchmark (like nano-vllm's bench.py): many random requests through one
`LLM.generate` call.

The workload is N requests with uniformly random prompt lengths, random token ids and uniformly
random output lengths, generated with EOS ignored so every request produces exactly its output
length. Used by `nanoqwen bench` and by bench/bench_throughput.py (which adds a transformers
baseline on the same requests).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from nanoqwen.attention.kv_cache import KVCache
from nanoqwen.entrypoints.engine_args import add_parallel_and_quantization_args
from nanoqwen.entrypoints.llm import LLM
from nanoqwen.errors import InvalidRequestError
from nanoqwen.model_loader.init_random import write_random_model
from nanoqwen.sampling_params import SamplingParams

Workload = list[tuple[list[int], int]]  # (prompt token ids, output length) per request
# random prompt token ids are drawn from [0, TOKEN_ID_LIMIT), as in nano-vllm
TOKEN_ID_LIMIT = 10000
SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}  # Qwen3's recommended sampling
# Defaults sized to finish in minutes on a 2-core CPU, and (--gpu-workload) nano-vllm's GPU-sized
# workload. On CPU the KV cache takes RAM as blocks are first used, and a prefix cache keeps what
# it used: the budget is sized to the workload (32 sequences of the average 416 tokens take 1.4 GiB
# at Qwen3-0.6B's 112 KiB a token; the longest, 768, would take 2.6 GiB: the scheduler preempts
# when the cache runs short).
CPU_WORKLOAD = {"num_requests": 64, "min_input": 32, "max_input": 512, "min_output": 32,
                "max_output": 256, "max_num_seqs": 32, "max_num_batched_tokens": 2048,
                "kv_cache_gib": 1.5}
GPU_WORKLOAD = {"num_requests": 256, "min_input": 100, "max_input": 1024, "min_output": 100,
                "max_output": 1024, "max_num_seqs": 256, "max_num_batched_tokens": 16384}


def default_checkpoint_dir() -> Path:
    """Where `nanoqwen bench` keeps its random Qwen3-0.6B-shaped checkpoint."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "nanoqwen" / "random-qwen3-0.6b"


def ensure_random_checkpoint(path: str | Path, preset: str = "qwen3-0.6b") -> Path:
    """Write a random-weight bfloat16 checkpoint of the preset's shape to path unless it has a
    config.json.

    The folder is written under a temporary name and renamed when complete, so an interrupted write
    never leaves a folder that looks finished.
    """
    path = Path(path).expanduser()
    if (path / "config.json").exists():
        return path
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    write_random_model(partial, preset, dtype="bfloat16")
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(path, ignore_errors=True)  # an empty or half-made folder without config.json
    partial.rename(path)
    return path


def make_workload(num_requests: int, min_input: int, max_input: int, min_output: int,
                  max_output: int, seed: int = 0) -> Workload:
    """N (prompt token ids, output length) pairs; lengths uniform in [min, max] (inclusive),
    same for a seed."""
    if num_requests < 1:
        raise InvalidRequestError(f"num_requests={num_requests} must be >= 1")
    for name, lo, hi in (("input", min_input, max_input), ("output", min_output, max_output)):
        if not 1 <= lo <= hi:
            raise InvalidRequestError(f"{name} lengths [{lo}, {hi}] must satisfy 1 <= min <= max")
    rng = random.Random(seed)
    workload = []
    for _ in range(num_requests):
        prompt = [rng.randrange(TOKEN_ID_LIMIT) for _ in range(rng.randint(min_input, max_input))]
        workload.append((prompt, rng.randint(min_output, max_output)))
    return workload


def run_nanoqwen(model_dir: str | Path, workload: Workload, device: str | None = None,
                 dtype: str = "bfloat16", **engine_kwargs: Any) -> dict[str, Any]:
    """Load the model, warm up, then time one `generate` call over the whole workload.

    engine_kwargs (max_num_seqs, max_num_batched_tokens, kv_cache_memory, ...) go to `LLM(...)`;
    max_model_len defaults to the longest prompt plus the longest output of the workload.
    """
    engine_kwargs.setdefault("max_model_len",
                             max(len(p) for p, _ in workload) + max(n for _, n in workload))
    llm = LLM(str(model_dir), dtype=dtype, device=device, **engine_kwargs)
    engine = llm.llm_engine
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    warmup = [[1 + i, 2 + i, 3 + i, 4 + i, 5 + i, 6 + i, 7 + i, 8 + i] for i in range(2)]
    llm.generate(warmup, SamplingParams(max_tokens=4, ignore_eos=True, **SAMPLING), use_tqdm=False)
    engine.block_manager.peak_used_blocks = 0
    preemptions = engine.scheduler.num_preemptions

    prompts = [p for p, _ in workload]
    params = [SamplingParams(seed=i, max_tokens=n, ignore_eos=True, **SAMPLING)
              for i, (_, n) in enumerate(workload)]
    sync()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    seconds = time.perf_counter() - start

    input_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(len(o.token_ids) for o in outputs)
    stats = engine.kv_cache_stats
    c = engine.config
    per_token = KVCache.bytes_per_token(c.num_hidden_layers, engine.model.num_kv_heads, c.head_dim,
                                        engine.dtype, engine.engine_config.kv_cache_dtype)  # per rank
    capacity = stats["num_blocks"] * stats["block_size"]
    result: dict[str, Any] = {
        "requests": len(workload),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "seconds": seconds,
        "output_tok_s": output_tokens / seconds,
        "total_tok_s": (input_tokens + output_tokens) / seconds,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "weight_gib": sum(engine.rank_weight_bytes) / 2**30,  # every rank's
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "engine_kwargs": dict(engine_kwargs),
        "kv_cache": {
            "capacity_tokens": capacity, "capacity_gib": capacity * per_token / 2**30,
            "peak_blocks": stats["peak_used_blocks"], "num_blocks": stats["num_blocks"],
            "block_size": stats["block_size"],
            "peak_gib": stats["peak_used_blocks"] * stats["block_size"] * per_token / 2**30,
            "preemptions": engine.scheduler.num_preemptions - preemptions,
            "prefix_cache_hit_rate": stats["prefix_cache_hit_rate"],
        },
    }
    if engine.device.type == "cuda":
        result["peak_cuda_gib"] = torch.cuda.max_memory_allocated(engine.device) / 2**30
    return result


def describe_engine(kwargs: dict[str, Any]) -> str:
    """The engine settings of a run, e.g.
    "max_num_seqs 64, max_num_batched_tokens 2048, kv_cache_memory 4 GiB"."""
    def value(key: str, v: Any) -> str:
        return f"{v / 2**30:g} GiB" if key == "kv_cache_memory" and isinstance(v, int) else str(v)

    return ", ".join(f"{k} {value(k, v)}" for k, v in kwargs.items() if k != "max_model_len")


def describe_kv(kv: dict[str, Any]) -> str:
    """One line about KV-cache use during the timed run."""
    return (f"peak {kv['peak_blocks']:,} of {kv['num_blocks']:,} blocks of {kv['block_size']} "
            f"in use ({kv['peak_gib']:.2f} GiB of a {kv['capacity_gib']:.2f} GiB cache holding "
            f"{kv['capacity_tokens']:,} tokens); {kv['preemptions']} preemptions; "
            f"prefix-cache hit rate {kv['prefix_cache_hit_rate']:.1%}")


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """The workload and engine flags shared by `nanoqwen bench` and bench/bench_throughput.py."""
    c, g = CPU_WORKLOAD, GPU_WORKLOAD
    p.add_argument("--num-requests", type=int, default=None,
                   help=f"requests (default {c['num_requests']})")
    p.add_argument("--min-input", type=int, default=None,
                   help=f"shortest prompt (default {c['min_input']})")
    p.add_argument("--max-input", type=int, default=None,
                   help=f"longest prompt (default {c['max_input']})")
    p.add_argument("--min-output", type=int, default=None,
                   help=f"shortest output (default {c['min_output']})")
    p.add_argument("--max-output", type=int, default=None,
                   help=f"longest output (default {c['max_output']})")
    p.add_argument("--seed", type=int, default=0, help="workload seed (prompts and lengths)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="default: cuda when available")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help=f"sequences per step (default {c['max_num_seqs']})")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help=f"tokens per step (default {c['max_num_batched_tokens']})")
    p.add_argument("--gpu-workload", action="store_true",
                   help=f"GPU-sized defaults: {g['num_requests']} requests, prompts and outputs "
                        f"{g['min_input']}-{g['max_input']} tokens, "
                        f"max-num-seqs {g['max_num_seqs']}, "
                        f"max-num-batched-tokens {g['max_num_batched_tokens']} "
                        "(flags given still win)")
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="KV-cache size in GiB (default: 1.5 for the CPU workload; "
                        "the engine's own default with --gpu-workload)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no torch.compile (CPU) and no CUDA graphs (GPU): "
                        "faster start-up, slower steps")
    add_parallel_and_quantization_args(p)
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra LLM(...) keyword, value as JSON or a string, "
                        "e.g. enable_prefix_caching=false or kv_cache_memory=0.5 (repeatable)")


def resolve_bench_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the flags left unset from the CPU or GPU workload, and the device from what torch
    sees."""
    defaults = GPU_WORKLOAD if args.gpu_workload else CPU_WORKLOAD
    unset = {key for key in defaults if getattr(args, key) is None}
    for key in unset:
        setattr(args, key, defaults[key])
    # a default bound gives way to a given one: --max-output 16 means 16-16
    for kind in ("input", "output"):
        lo, hi = f"min_{kind}", f"max_{kind}"
        if lo in unset and hi not in unset:
            setattr(args, lo, min(getattr(args, lo), getattr(args, hi)))
        elif hi in unset and lo not in unset:
            setattr(args, hi, max(getattr(args, lo), getattr(args, hi)))
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The `LLM(...)` keywords the flags ask for (max_model_len: the longest prompt plus the
    longest output)."""
    kwargs: dict[str, Any] = {"max_num_seqs": args.max_num_seqs,
                              "max_num_batched_tokens": args.max_num_batched_tokens,
                              "max_model_len": args.max_input + args.max_output}
    if args.kv_cache_gib is not None:
        if not args.kv_cache_gib > 0:
            raise InvalidRequestError(f"--kv-cache-gib {args.kv_cache_gib} must be > 0")
        kwargs["kv_cache_memory"] = int(args.kv_cache_gib * 2**30)
    if getattr(args, "enforce_eager", False):
        kwargs["enforce_eager"] = True
    if getattr(args, "tensor_parallel_size", 1) != 1:
        kwargs["tensor_parallel_size"] = args.tensor_parallel_size
    if getattr(args, "quantization", None):
        kwargs["quantization"] = args.quantization
    if getattr(args, "speculative_config", None):
        kwargs["speculative_config"] = args.speculative_config
    for item in args.engine_arg:
        key, sep, raw = item.partition("=")
        if not sep or not key.isidentifier():
            raise InvalidRequestError(f"--engine-arg {item!r} is not KEY=VALUE")
        try:
            kwargs[key] = json.loads(raw)
        except json.JSONDecodeError:
            kwargs[key] = raw
    return kwargs


def workload_from_args(args: argparse.Namespace) -> Workload:
    """The workload the (resolved) flags describe."""
    return make_workload(args.num_requests, args.min_input, args.max_input, args.min_output,
                         args.max_output, args.seed)


def format_report(result: dict[str, Any], model_dir: str | Path,
                  args: argparse.Namespace) -> str:
    """A small human-readable table of one `run_nanoqwen` result."""
    rows = [
        ("model", f"{model_dir} ({result['device']}, {result['dtype']}; "
                  f"{result['weight_gib']:.2f} GiB of weights)"),
        ("engine", describe_engine(result["engine_kwargs"])),
        ("requests", f"{result['requests']}, seed {args.seed}; "
                     "temperature 0.6, top-p 0.95, top-k 20, EOS ignored"),
        ("prompts", f"{args.min_input}-{args.max_input} tokens each, "
                    f"{result['input_tokens']:,} in all"),
        ("outputs", f"{args.min_output}-{args.max_output} tokens each, "
                    f"{result['output_tokens']:,} in all"),
        ("time", f"{result['seconds']:.2f} s"),
        ("output tokens/s", f"{result['output_tok_s']:.1f}"),
        ("total tokens/s", f"{result['total_tok_s']:.1f} (prompt + output)"),
        ("peak memory", f"{result['peak_rss_gib']:.2f} GiB max RSS"
                        + (f", {result['peak_cuda_gib']:.2f} GiB CUDA allocated"
                           if "peak_cuda_gib" in result else "")),
    ]
    rows.append(("KV cache", describe_kv(result["kv_cache"])))
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)
