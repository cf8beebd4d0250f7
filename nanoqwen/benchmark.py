"""Throughput benchmark (like nano-vllm's bench.py): many random requests through one `LLM.generate` call.

The workload is N requests with uniformly random prompt lengths, random token ids and uniformly random
output lengths, generated with EOS ignored so every request produces exactly its output length. Used by
`nanoqwen bench` and by bench/bench_throughput.py (which adds a transformers baseline on the same requests).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import random
import resource
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from nanoqwen.errors import InvalidRequestError

Workload = list[tuple[list[int], int]]  # (prompt token ids, output length) per request
TOKEN_ID_LIMIT = 10000  # random prompt token ids are drawn from [0, TOKEN_ID_LIMIT), as in nano-vllm
SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}  # Qwen3's recommended sampling
# Defaults sized to finish in minutes on a 2-core CPU, and (--gpu-workload) nano-vllm's GPU-sized workload.
CPU_WORKLOAD = {"num_requests": 64, "min_input": 32, "max_input": 512, "min_output": 32, "max_output": 256,
                "max_num_seqs": 64, "max_num_batched_tokens": 2048}
GPU_WORKLOAD = {"num_requests": 256, "min_input": 100, "max_input": 1024, "min_output": 100, "max_output": 1024,
                "max_num_seqs": 256, "max_num_batched_tokens": 16384}


def default_checkpoint_dir() -> Path:
    """Where `nanoqwen bench` keeps its random Qwen3-0.6B-shaped checkpoint."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "nanoqwen" / "random-qwen3-0.6b"


def ensure_random_checkpoint(path: str | Path, preset: str = "qwen3-0.6b") -> Path:
    """Write a random-weight bfloat16 checkpoint of the preset's shape to path unless it has a config.json.

    The folder is written under a temporary name and renamed when complete, so an interrupted write never
    leaves a folder that looks finished.
    """
    from nanoqwen.init_random import write_random_model

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


def make_workload(num_requests: int, min_input: int, max_input: int, min_output: int, max_output: int,
                  seed: int = 0) -> Workload:
    """N (prompt token ids, output length) pairs; lengths uniform in [min, max] (inclusive), same for a seed."""
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


def engine_kwargs_accepted(**kwargs: Any) -> tuple[dict[str, Any], list[str]]:
    """Split kwargs into those `LLM.__init__` accepts and the names it does not (the engine is evolving)."""
    from nanoqwen.llm import LLM

    params = inspect.signature(LLM.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(kwargs), []
    accepted = {k: v for k, v in kwargs.items() if k in params}
    return accepted, sorted(set(kwargs) - set(accepted))


def run_nanoqwen(model_dir: str | Path, workload: Workload, device: str | None = None, dtype: str = "bfloat16",
                 **engine_kwargs: Any) -> dict[str, Any]:
    """Load the model, warm up, then time one `generate` call over the whole workload.

    engine_kwargs (max_num_seqs, max_num_batched_tokens, kv_cache_memory, ...) go to `LLM(...)` when it
    accepts them; the rest are listed under "ignored_engine_kwargs". max_model_len defaults to the longest
    prompt plus the longest output of the workload.
    """
    from nanoqwen.llm import LLM
    from nanoqwen.sampling_params import SamplingParams

    max_len = max(len(p) for p, _ in workload) + max(n for _, n in workload)
    engine_kwargs.setdefault("max_model_len", max_len)
    accepted, ignored = engine_kwargs_accepted(**engine_kwargs)
    llm = LLM(str(model_dir), dtype=dtype, device=device, **accepted)
    engine = llm.llm_engine
    dev = torch.device(getattr(engine, "device", None) or device or "cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    warmup = [[1 + i, 2 + i, 3 + i, 4 + i, 5 + i, 6 + i, 7 + i, 8 + i] for i in range(2)]
    llm.generate(warmup, SamplingParams(max_tokens=4, ignore_eos=True, **SAMPLING), use_tqdm=False)

    prompts = [p for p, _ in workload]
    params = [SamplingParams(seed=i, max_tokens=n, ignore_eos=True, **SAMPLING) for i, (_, n) in enumerate(workload)]
    tally = _KVTally(engine)
    preemptions = getattr(getattr(engine, "scheduler", None), "num_preemptions", None)
    sync()
    start = time.perf_counter()
    with tally:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    seconds = time.perf_counter() - start

    input_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(len(o.token_ids) for o in outputs)
    result: dict[str, Any] = {
        "requests": len(workload),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "seconds": seconds,
        "output_tok_s": output_tokens / seconds,
        "total_tok_s": (input_tokens + output_tokens) / seconds,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "device": str(dev),
        "dtype": str(getattr(engine, "dtype", dtype)).removeprefix("torch."),
        "engine_kwargs": dict(accepted),
        "ignored_engine_kwargs": ignored,
        "kv_cache": kv_cache_use(engine, tally),
    }
    if isinstance(preemptions, int):
        result["kv_cache"]["preemptions"] = engine.scheduler.num_preemptions - preemptions
    if dev.type == "cuda":
        result["peak_cuda_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
    return result


class _KVTally:
    """While active, records at every scheduled step how many tokens the cache will hold after it.

    It wraps the scheduler's `schedule` (the point where a step's tokens are given cache space and before any
    finished sequence lets go of its own), so it costs a sum over the running sequences per step. It looks at
    the scheduler's `running` sequences and their `num_computed_tokens`, and at the block manager's free
    blocks where there is one; an engine without them gets no tally rather than a wrong one.
    """

    def __init__(self, engine: Any) -> None:
        self.scheduler = getattr(engine, "scheduler", None)
        self.peak_tokens: int | None = None
        self.peak_blocks: int | None = None

    def __enter__(self) -> _KVTally:
        scheduler = self.scheduler
        schedule = getattr(scheduler, "schedule", None)
        if not isinstance(getattr(scheduler, "running", None), list) or not callable(schedule):
            return self
        blocks = getattr(scheduler, "block_manager", None)
        if not (hasattr(blocks, "num_blocks") and hasattr(blocks, "num_free_blocks")):
            blocks = None
        self.peak_tokens, self.peak_blocks = 0, 0 if blocks is not None else None

        def counted_schedule(*args: Any, **kwargs: Any) -> Any:
            batch = schedule(*args, **kwargs)
            try:
                new = len(batch.decode) + sum(n for _, n in batch.prefill)
                held = sum(s.num_computed_tokens for s in scheduler.running) + new
            except (AttributeError, TypeError):
                return batch
            self.peak_tokens = max(self.peak_tokens, held)
            if blocks is not None:
                self.peak_blocks = max(self.peak_blocks, blocks.num_blocks - blocks.num_free_blocks)
            return batch

        scheduler.schedule = counted_schedule  # an instance attribute: shadows the method until __exit__
        return self

    def __exit__(self, *exc: object) -> None:
        if self.scheduler is not None:
            vars(self.scheduler).pop("schedule", None)


def kv_cache_use(engine: Any, tally: _KVTally | None = None) -> dict[str, Any]:
    """What is known about KV-cache use: the engine's own stats when it has them, plus the peak tally."""
    info: dict[str, Any] = {}
    stats = getattr(engine, "kv_cache_stats", None)
    if callable(stats):
        stats = stats()
    if dataclasses.is_dataclass(stats) and not isinstance(stats, type):
        stats = dataclasses.asdict(stats)
    if stats is not None:
        info["engine"] = stats if isinstance(stats, dict) else repr(stats)
    config, dtype = getattr(engine, "config", None), getattr(engine, "dtype", None)
    try:
        per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype.itemsize
    except AttributeError:
        per_token = None
    if per_token:
        info["bytes_per_token"] = per_token
    cache = getattr(getattr(engine, "runner", None), "kv_cache", None)
    tensors = [t for t in (getattr(cache, "k", None), getattr(cache, "v", None)) if isinstance(t, torch.Tensor)]
    if tensors:
        info["capacity_gib"] = sum(t.numel() * t.element_size() for t in tensors) / 2**30
        if per_token:
            info["capacity_tokens"] = sum(t.numel() * t.element_size() for t in tensors) // per_token
    blocks = getattr(getattr(engine, "scheduler", None), "block_manager", None)
    if hasattr(blocks, "num_blocks") and hasattr(blocks, "block_size"):
        info["num_blocks"], info["block_size"] = blocks.num_blocks, blocks.block_size
    if tally is not None and tally.peak_tokens is not None:
        info["peak_tokens"] = tally.peak_tokens
        if per_token:
            info["peak_gib"] = tally.peak_tokens * per_token / 2**30
    if tally is not None and tally.peak_blocks is not None:
        info["peak_blocks"] = tally.peak_blocks
    return info


def describe_engine(kwargs: dict[str, Any]) -> str:
    """The engine settings of a run, e.g. "max_num_seqs 64, max_num_batched_tokens 2048, kv_cache_memory 4 GiB"."""
    def value(key: str, v: Any) -> str:
        return f"{v / 2**30:g} GiB" if key == "kv_cache_memory" and isinstance(v, int) else str(v)

    return ", ".join(f"{k} {value(k, v)}" for k, v in kwargs.items() if k != "max_model_len")


def describe_kv(kv: dict[str, Any]) -> str:
    """One line about KV-cache use, from `kv_cache_use`'s dict (empty when nothing is known)."""
    parts = []
    if "peak_tokens" in kv:
        line = f"peak {kv['peak_tokens']:,} tokens held by running sequences"
        if "peak_gib" in kv:
            line += f" ({kv['peak_gib']:.2f} GiB)"
        if kv.get("capacity_tokens"):
            line += f", {kv['peak_tokens'] / kv['capacity_tokens']:.0%} of"
        parts.append(line)
    if kv.get("capacity_tokens"):
        cap = f"a cache of {kv['capacity_tokens']:,} tokens ({kv['capacity_gib']:.2f} GiB)"
        parts.append(f"{parts.pop()} {cap}" if parts else cap)
    if "peak_blocks" in kv:
        parts.append(f"peak {kv['peak_blocks']:,} of {kv['num_blocks']:,} blocks of {kv['block_size']} in use")
    if "preemptions" in kv:
        parts.append(f"{kv['preemptions']} preemptions")
    engine = kv.get("engine")
    if isinstance(engine, dict):  # end-of-run snapshots (blocks in use, running, ...) say nothing; rates do
        snapshot = {"num_blocks", "block_size", "used_blocks", "usage", "num_preemptions", "num_running",
                    "num_waiting"}
        parts += [f"{key.replace('_', ' ')} {value:.1%}" if isinstance(value, float) and key.endswith("rate")
                  else f"{key.replace('_', ' ')} {value}" for key, value in engine.items() if key not in snapshot]
    elif engine is not None:
        parts.append(f"engine: {engine}")
    return "; ".join(parts)


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """The workload and engine flags shared by `nanoqwen bench` and bench/bench_throughput.py."""
    c, g = CPU_WORKLOAD, GPU_WORKLOAD
    p.add_argument("--num-requests", type=int, default=None, help=f"requests (default {c['num_requests']})")
    p.add_argument("--min-input", type=int, default=None, help=f"shortest prompt (default {c['min_input']})")
    p.add_argument("--max-input", type=int, default=None, help=f"longest prompt (default {c['max_input']})")
    p.add_argument("--min-output", type=int, default=None, help=f"shortest output (default {c['min_output']})")
    p.add_argument("--max-output", type=int, default=None, help=f"longest output (default {c['max_output']})")
    p.add_argument("--seed", type=int, default=0, help="workload seed (prompts and lengths)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help=f"sequences per step (default {c['max_num_seqs']})")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help=f"tokens per step (default {c['max_num_batched_tokens']})")
    p.add_argument("--gpu-workload", action="store_true",
                   help=f"GPU-sized defaults: {g['num_requests']} requests, prompts and outputs "
                        f"{g['min_input']}-{g['max_input']} tokens, max-num-seqs {g['max_num_seqs']}, "
                        f"max-num-batched-tokens {g['max_num_batched_tokens']} (flags given still win)")
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="KV-cache size in GiB (default: the engine's; on CPU 4 GiB or half the free memory)")
    p.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra LLM(...) keyword, value as JSON or a string, e.g. enable_prefix_caching=false or "
                        "kv_cache_memory=0.5 (repeatable; dropped with a note if this LLM does not take it)")


def resolve_bench_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the flags left unset from the CPU or GPU workload, and the device from what torch sees."""
    defaults = GPU_WORKLOAD if args.gpu_workload else CPU_WORKLOAD
    unset = {key for key in defaults if getattr(args, key) is None}
    for key in unset:
        setattr(args, key, defaults[key])
    for kind in ("input", "output"):  # a default bound gives way to a given one: --max-output 16 means 16-16
        lo, hi = f"min_{kind}", f"max_{kind}"
        if lo in unset and hi not in unset:
            setattr(args, lo, min(getattr(args, lo), getattr(args, hi)))
        elif hi in unset and lo not in unset:
            setattr(args, hi, max(getattr(args, lo), getattr(args, hi)))
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The `LLM(...)` keywords the flags ask for (max_model_len: the longest prompt plus the longest output)."""
    kwargs: dict[str, Any] = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                              "max_model_len": args.max_input + args.max_output}
    if args.kv_cache_gib is not None:
        if not args.kv_cache_gib > 0:
            raise InvalidRequestError(f"--kv-cache-gib {args.kv_cache_gib} must be > 0")
        kwargs["kv_cache_memory"] = int(args.kv_cache_gib * 2**30)
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
    return make_workload(args.num_requests, args.min_input, args.max_input, args.min_output, args.max_output,
                         args.seed)


def format_report(result: dict[str, Any], model_dir: str | Path, args: argparse.Namespace) -> str:
    """A small human-readable table of one `run_nanoqwen` result."""
    ignored = result["ignored_engine_kwargs"]
    rows = [
        ("model", f"{model_dir} ({result['device']}, {result['dtype']})"),
        ("engine", describe_engine(result["engine_kwargs"]) + (f"; ignored: {', '.join(ignored)}" if ignored else "")),
        ("requests", f"{result['requests']}, seed {args.seed}; temperature 0.6, top-p 0.95, top-k 20, EOS ignored"),
        ("prompts", f"{args.min_input}-{args.max_input} tokens each, {result['input_tokens']:,} in all"),
        ("outputs", f"{args.min_output}-{args.max_output} tokens each, {result['output_tokens']:,} in all"),
        ("time", f"{result['seconds']:.2f} s"),
        ("output tokens/s", f"{result['output_tok_s']:.1f}"),
        ("total tokens/s", f"{result['total_tok_s']:.1f} (prompt + output)"),
        ("peak memory", f"{result['peak_rss_gib']:.2f} GiB max RSS"
                        + (f", {result['peak_cuda_gib']:.2f} GiB CUDA allocated" if "peak_cuda_gib" in result
                           else "")),
    ]
    kv = describe_kv(result["kv_cache"])
    if kv:
        rows.append(("KV cache", kv))
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)
