"""Tensor parallelism on CPU: the same workload with tensor_parallel_size 1 and 2.

    python bench/bench_tp.py                     # random Qwen3-0.6B-shaped checkpoint, bfloat16: 1x2 2x1
    python bench/bench_tp.py --configs 1x2 1x1 2x1 --repeat 3
    python bench/bench_tp.py --model DIR --configs 1x8 2x4 4x2

A config SIZExTHREADS runs tensor_parallel_size SIZE with THREADS torch threads per rank, in its own process
tree (the ranks talk over gloo). 1x2 vs 2x1 gives both the same two cores. --repeat R alternates the configs
R times and keeps each one's best run, so a burst of other work on a shared machine does not land on one
config only.

Two measures: throughput of one `generate` over a batch of random requests, and single-stream decode (one
request, where every step pays the all-reduces: two per layer, plus the embedding and the LM-head gather).
Also each rank's peak memory (max RSS): the weights are split N ways.

On a 2-core machine TP=2 should not be faster: the same cores do the same matmuls, plus the communication.
It proves the plumbing; the speed-up needs ranks on their own GPUs (or sockets).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from nanoqwen.entrypoints import benchmark


def child(args: argparse.Namespace, size: int, threads: int) -> dict:
    import torch

    from nanoqwen import LLM, SamplingParams

    torch.set_num_threads(threads)  # the workers take rank 0's thread count
    start = time.perf_counter()
    llm = LLM(str(args.model), dtype=args.dtype, device="cpu", max_model_len=1024, kv_cache_memory=512 << 20,
              tensor_parallel_size=size, max_num_seqs=args.num_requests)
    load_s = time.perf_counter() - start
    workload = benchmark.make_workload(args.num_requests, args.min_input, args.max_input, args.output_len,
                                       args.output_len, seed=0)
    params = [SamplingParams(seed=i, max_tokens=n, ignore_eos=True, **benchmark.SAMPLING)
              for i, (_, n) in enumerate(workload)]
    llm.generate([[1, 2, 3, 4]] * 2, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in workload], params, use_tqdm=False)
    batch_s = time.perf_counter() - start
    single = SamplingParams(temperature=0, max_tokens=args.single_len, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([workload[0][0][:32]], single, use_tqdm=False)
    single_s = time.perf_counter() - start
    rss = [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20]
    group = llm.llm_engine.tp_group
    for proc in group.procs if group else []:
        status = Path(f"/proc/{proc.pid}/status").read_text()
        rss.append(int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM"))) / 2**20)
    llm.llm_engine.shutdown()
    input_tokens = sum(len(p) for p, _ in workload)
    output_tokens = sum(len(o.token_ids) for o in outs)
    return {"size": size, "threads_per_rank": torch.get_num_threads(), "load_s": load_s,
            "batch_s": batch_s, "batch_output_tok_s": output_tokens / batch_s,
            "batch_total_tok_s": (input_tokens + output_tokens) / batch_s,
            "single_decode_tok_s": args.single_len / single_s, "peak_rss_gib_per_rank": rss,
            "input_tokens": input_tokens, "output_tokens": output_tokens}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="default: the random Qwen3-0.6B-shaped checkpoint")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--configs", nargs="+", default=["1x2", "2x1"],
                   help="SIZExTHREADS: tensor_parallel_size and threads per rank (default: 1x2 2x1)")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--min-input", type=int, default=64)
    p.add_argument("--max-input", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--single-len", type=int, default=64, help="tokens decoded by the single stream")
    p.add_argument("--repeat", type=int, default=1, help="alternate the configs this many times, keep each best")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.model is None:
        args.model = benchmark.ensure_random_checkpoint(benchmark.default_checkpoint_dir())
    if args.child is not None:
        size, threads = map(int, args.child.split("x"))
        print(json.dumps(child(args, size, threads)))
        return
    best: dict[str, dict] = {}
    for _ in range(args.repeat):
        for config in args.configs:
            cmd = [sys.executable, __file__, *sys.argv[1:], "--child", config]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            run = json.loads(out.strip().splitlines()[-1])
            print(json.dumps(run), file=sys.stderr)
            for key in ("batch_output_tok_s", "batch_total_tok_s", "single_decode_tok_s"):
                run[key] = max(run[key], best.get(config, run)[key])
            best[config] = run
    results = [best[config] for config in args.configs]
    base = results[0]
    print(f"model {args.model} ({args.dtype}); {args.num_requests} requests, prompts "
          f"{args.min_input}-{args.max_input} tokens, {args.output_len} output tokens each; single stream "
          f"{args.single_len} tokens; best of {args.repeat} alternating run(s)\n")
    print("| tensor_parallel_size | threads/rank | batch output tok/s | batch total tok/s | single-stream decode "
          "tok/s | peak RSS per rank (GiB) | load (s) |")
    print("|---:|---:|---:|---:|---:|---|---:|")
    for r in results:
        ratio = f" ({r['batch_output_tok_s'] / base['batch_output_tok_s']:.2f}×)" if r is not base else ""
        single = f" ({r['single_decode_tok_s'] / base['single_decode_tok_s']:.2f}×)" if r is not base else ""
        rss = ", ".join(f"{x:.2f}" for x in r["peak_rss_gib_per_rank"])
        print(f"| {r['size']} | {r['threads_per_rank']} | {r['batch_output_tok_s']:.1f}{ratio} | "
              f"{r['batch_total_tok_s']:.1f} | {r['single_decode_tok_s']:.1f}{single} | {rss} | {r['load_s']:.1f} |")


if __name__ == "__main__":
    main()
