"""Serving benchmark: `nanoqwen serve` on loopback, streamed requests at a few concurrency levels.

    python bench/bench_serving.py                  # random checkpoint with the exact Qwen3-0.6B shape; 1, 4, 16
    python bench/bench_serving.py --write          # also record the table in BENCHMARKS.md
    python bench/bench_serving.py --model DIR --concurrency 1,2 --num-prompts 4 --input-len 16 --output-len 8

The server runs in its own process, as in production; the client (asyncio + httpx) streams /v1/completions
with random token-id prompts, Qwen3's sampling (temperature 0.6, top-p 0.95, top-k 20) and EOS ignored, so
every request generates exactly --output-len tokens. At concurrency C, C requests are in flight at any time
until all --num-prompts (default 4 C, at least 8) are done. Reported per level: requests/s and output
tokens/s over the level's wall time; TTFT (request sent -> first text chunk) and TPOT (mean gap between
tokens after the first, per request) at p50 and p99.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_model  # noqa: E402  (bench/ is not a package)

from nanoqwen.distributed import free_port  # noqa: E402

SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


def start_server(model_dir: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """`nanoqwen serve --model model_dir FLAGS` on a free loopback port, in its own process, once /health answers:
    (the process, its base URL). Exits the benchmark if it does not start within 10 minutes."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "nanoqwen", "serve", "--model", str(model_dir), "--port",
                             str(port), *flags])
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            sys.exit("the server did not start")
        time.sleep(0.2)


async def one_request(client: httpx.AsyncClient, base: str, prompt: list[int], output_len: int) -> dict:
    body = {"prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **SAMPLING}
    start, first, tokens = time.perf_counter(), None, 0
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if first is None and event["choices"] and event["choices"][0]["text"]:
                first = time.perf_counter()
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    end = time.perf_counter()
    first = first or end
    return {"start": start, "end": end, "ttft": first - start, "tokens": tokens,
            "tpot": (end - first) / (tokens - 1) if tokens > 1 else None}


async def run_level(base: str, concurrency: int, prompts: list[list[int]], output_len: int) -> dict:
    limit = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        async def bounded(prompt: list[int]) -> dict:
            async with limit:
                return await one_request(client, base, prompt, output_len)

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(p) for p in prompts))
        seconds = time.perf_counter() - start
    ttft = np.array([r["ttft"] for r in results]) * 1000
    tpot = np.array([r["tpot"] for r in results if r["tpot"] is not None] or [float("nan")]) * 1000
    return {"concurrency": concurrency, "requests": len(results), "seconds": seconds,
            "req_s": len(results) / seconds, "out_tok_s": sum(r["tokens"] for r in results) / seconds,
            "ttft_p50": np.percentile(ttft, 50), "ttft_p99": np.percentile(ttft, 99),
            "tpot_p50": np.percentile(tpot, 50), "tpot_p99": np.percentile(tpot, 99)}


def table(rows: list[dict]) -> str:
    lines = ["| concurrency | requests | requests/s | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) "
             "| TPOT p99 (ms) |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {r['requests']} | {r['req_s']:.2f} | {r['out_tok_s']:.1f} | "
                     f"{r['ttft_p50']:.0f} | {r['ttft_p99']:.0f} | {r['tpot_p50']:.1f} | {r['tpot_p99']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help=f"model folder (default: a random one in {bench_model.DEFAULT_DIR})")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated levels (default 1,4,16)")
    parser.add_argument("--num-prompts", type=int, default=None, help="requests per level (default 4x, >= 8)")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens (default 128)")
    parser.add_argument("--output-len", type=int, default=64, help="generated tokens (default 64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--write", action="store_true", help="record the table in BENCHMARKS.md")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    model_dir = Path(args.model) if args.model else bench_model.DEFAULT_DIR
    if not (model_dir / "config.json").exists():
        from nanoqwen.model_loader.init_random import write_random_model

        print(f"writing a random Qwen3-0.6B-shaped checkpoint to {model_dir} ...", file=sys.stderr)
        write_random_model(model_dir, "qwen3-0.6b", dtype="bfloat16", std=0.02)
    rng = random.Random(args.seed)
    proc, base = start_server(model_dir, "--dtype", args.dtype, "--device", args.device, "--max-model-len",
                              str(args.input_len + args.output_len + 8), "--max-num-seqs", str(max(max(levels), 1)),
                              "--max-waiting", "100000", "--log-level", "warning")
    rows = []
    try:
        warmup = [[rng.randrange(10000) for _ in range(args.input_len)] for _ in range(2)]
        asyncio.run(run_level(base, 2, warmup, min(4, args.output_len)))
        for c in levels:
            n = args.num_prompts or max(4 * c, 8)
            # Fresh random prompts per level: no prefix-cache hits between requests or levels.
            prompts = [[rng.randrange(10000) for _ in range(args.input_len)] for _ in range(n)]
            print(f"concurrency {c}: {n} requests ...", file=sys.stderr)
            rows.append(asyncio.run(run_level(base, c, prompts, args.output_len)))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    name = "a random checkpoint with the exact Qwen3-0.6B shape" if not args.model else model_dir.name
    body = (f"### Serving: `nanoqwen serve` on loopback ({args.device}, {args.dtype})\n\n"
            f"`python bench/bench_serving.py{' --device cuda' if args.device == 'cuda' else ''}` on {name}: "
            f"streamed /v1/completions, {args.input_len}-token random prompts, {args.output_len} output tokens "
            "(EOS ignored), temperature 0.6 / top-p 0.95 / top-k 20; the server in its own process "
            f"(--max-num-seqs {max(levels)}), the client on asyncio + httpx.\n\n"
            f"{bench_model.machine_line(args.device)} · server and client share the machine\n\n"
            + table(rows))
    print(body)
    if args.write:
        bench_model.write_benchmarks(f"bench_serving-{args.device}", body)


if __name__ == "__main__":
    main()
