"""Throughput, nanoqwen vs transformers: N random requests (like nano-vllm's bench.py) on one machine, in one run.

    python bench/bench_throughput.py                  # 64 requests, prompts 32-512, outputs 32-256
    python bench/bench_throughput.py --gpu-workload --device cuda   # 256 requests, prompts and outputs 100-1024
    python bench/bench_throughput.py --write          # also record the table in BENCHMARKS.md

The workload (nanoqwen.entrypoints.benchmark.make_workload) is the same for both: random token ids, uniformly random
prompt and output lengths, sampling at temperature 0.6 / top-p 0.95 / top-k 20 with EOS ignored, so every
request produces exactly its output length. Each system runs in its own subprocess (so its peak memory is its
own) and times one pass over all requests after a warm-up:

- nanoqwen: one `LLM.generate` call; continuous batching and chunked prefill schedule the requests.
- transformers (sdpa attention): it has no continuous batching, so the requests run in their given order in
  batches of --hf-batch-size with `generate`, left-padded to the batch's longest prompt; each batch generates
  its longest output length. Only each request's own output length counts as output tokens: what a request
  generates past it is waste, as it would be in real use (where it would have stopped).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_model  # noqa: E402  (bench/ is not a package)

from nanoqwen.entrypoints import benchmark


def run_transformers(model_dir: str, workload: benchmark.Workload, device: str, dtype: str,
                     batch_size: int, time_budget: float | None = None) -> dict[str, Any]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa").to(device).eval()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def generate(batch: benchmark.Workload) -> int:
        """Generate for one batch; return how many tokens it generated (all rows, to its longest output)."""
        width, new = max(len(p) for p, _ in batch), max(n for _, n in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=device)
        config = transformers.GenerationConfig(do_sample=True, **benchmark.SAMPLING, max_new_tokens=new,
                                               min_new_tokens=new, eos_token_id=None, pad_token_id=0)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, generation_config=config)
        if out.shape[1] - width != new:
            raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens per row, not {new}")
        return out.shape[0] * new

    torch.manual_seed(0)
    generate([([1 + i, 2 + i, 3 + i, 4 + i, 5 + i, 6 + i, 7 + i, 8 + i], 4) for i in range(2)])  # warm-up
    sync()
    start = time.perf_counter()
    generated, done = 0, 0
    while done < len(workload):  # with a time budget, stop after the batch that exceeds it
        generated += generate(workload[done: done + batch_size])
        done = min(done + batch_size, len(workload))
        if time_budget is not None and time.perf_counter() - start > time_budget:
            break
    sync()
    seconds = time.perf_counter() - start
    workload = workload[:done]  # the requests that ran: rates are over them
    input_tokens, output_tokens = sum(len(p) for p, _ in workload), sum(n for _, n in workload)
    result = {
        "requests": len(workload), "input_tokens": input_tokens, "output_tokens": output_tokens,
        "generated_tokens": generated, "seconds": seconds, "output_tok_s": output_tokens / seconds,
        "total_tok_s": (input_tokens + output_tokens) / seconds,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }
    if device == "cuda":
        result["peak_cuda_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return result


def child(system: str, args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)  # as bench_model.py does, for both systems alike
    workload = benchmark.workload_from_args(args)
    if system == "nanoqwen":
        result = benchmark.run_nanoqwen(args.model, workload, args.device, args.dtype,
                                        **benchmark.engine_kwargs_from_args(args))
    else:
        result = run_transformers(args.model, workload, args.device, args.hf_dtype or args.dtype, args.hf_batch_size,
                                  args.hf_time_budget)
    print("RESULT " + json.dumps(result, default=str))


def run_child(system: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", system, "--model", str(args.model), "--device", args.device,
           "--dtype", args.dtype, "--seed", str(args.seed), "--hf-batch-size", str(args.hf_batch_size)]
    if args.hf_dtype:
        cmd += ["--hf-dtype", args.hf_dtype]
    for key in ("num_requests", "min_input", "max_input", "min_output", "max_output", "max_num_seqs",
                "max_num_batched_tokens"):
        cmd += ["--" + key.replace("_", "-"), str(getattr(args, key))]
    if args.kv_cache_gib is not None:
        cmd += ["--kv-cache-gib", str(args.kv_cache_gib)]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    if args.hf_time_budget is not None:
        cmd += ["--hf-time-budget", str(args.hf_time_budget)]
    for item in args.engine_arg:
        cmd += ["--engine-arg", item]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        sys.exit(f"{system} benchmark failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def table(ours: dict[str, Any], theirs: dict[str, Any]) -> str:
    rows = [
        ("Output tokens/s (each request's own length)", "output_tok_s", ".1f"),
        ("Total tokens/s (prompt + output)", "total_tok_s", ".1f"),
        ("Time (s)", "seconds", ".1f"),
        ("Tokens generated (transformers: to each batch's longest output)", "generated_tokens", ",d"),
        ("Peak memory (process max RSS, GiB)", "peak_rss_gib", ".2f"),
        ("Peak GPU memory (torch max allocated, GiB)", "peak_cuda_gib", ".2f"),
    ]
    ours = {**ours, "generated_tokens": ours["output_tokens"]}
    lines = ["| | nanoqwen | transformers | nanoqwen / transformers |", "|---|---:|---:|---:|"]
    for label, key, fmt in rows:
        if key in ours and key in theirs:
            ratio = "" if key == "seconds" else f"{ours[key] / theirs[key]:.2f}×"
            lines.append(f"| {label} | {ours[key]:{fmt}} | {theirs[key]:{fmt}} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help=f"model folder (default: a random Qwen3-0.6B-shaped one in {bench_model.DEFAULT_DIR})")
    benchmark.add_bench_args(parser)
    parser.add_argument("--hf-batch-size", type=int, default=16, help="transformers' generate batch size")
    parser.add_argument("--hf-time-budget", type=float, default=None, metavar="SECONDS",
                        help="stop transformers after the batch that passes this many seconds; its rates are then "
                             "over the requests it ran (the text says so)")
    parser.add_argument("--hf-dtype", default=None, choices=["bfloat16", "float32"],
                        help="transformers' dtype (default: --dtype; float32 is its faster choice on a CPU "
                             "without fast bf16)")
    parser.add_argument("--write", action="store_true", help="record the section in BENCHMARKS.md")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = benchmark.resolve_bench_args(parser.parse_args())
    if args.hf_batch_size < 1:
        parser.error("--hf-batch-size must be >= 1")
    if args.child:
        return child(args.child, args)
    workload = benchmark.workload_from_args(args)
    model_dir = Path(args.model) if args.model else bench_model.DEFAULT_DIR
    if not args.model and not (model_dir / "config.json").exists():
        print(f"writing a random Qwen3-0.6B-shaped checkpoint to {model_dir} ...", file=sys.stderr)
        benchmark.ensure_random_checkpoint(model_dir)
    args.model = model_dir
    results = {}
    for system in ("nanoqwen", "transformers"):
        print(f"running {system} ({len(workload)} requests) ...", file=sys.stderr)
        results[system] = r = run_child(system, args)
        print(f"{system}: {r['output_tok_s']:.1f} output tok/s, {r['requests']} requests in {r['seconds']:.1f} s",
              file=sys.stderr, flush=True)
    ours, theirs = results["nanoqwen"], results["transformers"]
    engine = benchmark.describe_engine(ours["engine_kwargs"])
    kv = benchmark.describe_kv(ours["kv_cache"])
    hf_dtype = f", {args.hf_dtype}" if args.hf_dtype and args.hf_dtype != args.dtype else ""
    name = "a random checkpoint with the exact Qwen3-0.6B shape" if model_dir == bench_model.DEFAULT_DIR \
        else model_dir.name
    command = bench_model.command_line("bench_throughput.py", sys.argv[1:])
    body = (f"### Throughput: {args.num_requests} requests, prompts {args.min_input}–{args.max_input} tokens, "
            f"outputs {args.min_output}–{args.max_output} tokens ({args.device}, {args.dtype})\n\n"
            f"`{command}` on {name}: {ours['requests']} requests of random token ids, "
            f"prompt and output lengths uniformly random "
            f"(seed {args.seed}; {ours['input_tokens']:,} prompt and {ours['output_tokens']:,} output tokens in all), "
            f"sampling at temperature 0.6, top-p 0.95, top-k 20, EOS ignored. nanoqwen: one `generate` call, "
            f"{engine}. transformers (sdpa{hf_dtype}): no continuous batching, so `generate` on the requests in their "
            f"given order in batches of {args.hf_batch_size}, left-padded; each batch runs to its longest output and "
            f"only each request's own output length counts.\n\n"
            f"{bench_model.machine_line(args.device)}\n\n"
            + (f"transformers ran out of its {args.hf_time_budget:g} s time budget (--hf-time-budget) after "
               f"{theirs['requests']} of the {ours['requests']} requests: its rates are over those.\n\n"
               if theirs["requests"] < ours["requests"] else "")
            + table(ours, theirs)
            + f"\n\nnanoqwen's KV cache: {kv}."
            + ("\n\nnanoqwen's peak GPU memory includes its KV-cache pool, allocated up front (by default most of "
               "the free memory; --kv-cache-gib sets it); transformers' cache grows with each batch."
               if args.device == "cuda" else ""))
    print(body)
    if args.write:
        bench_model.write_benchmarks(bench_model.section_name("bench_throughput", args.device), body)


if __name__ == "__main__":
    main()
