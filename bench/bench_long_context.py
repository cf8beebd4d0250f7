"""Long contexts on CPU: prompt processing and batch-1 decode at 1k, 4k and 16k tokens (32k with --lengths),
nanoqwen with each KV cache type (kv_cache_dtype) against llama.cpp with an f16 and a q8_0 cache (flash attention
on), on the same weights.

    python bench/bench_long_context.py [--lengths 1024 4096 16384 32768] [--write]

Systems (each in a process of its own, one after the other, all threads):
- nanoqwen on the bf16 checkpoint with kv_cache_dtype auto (bf16), int8 and fp8_e4m3, and with int4 weights and a
  bf16 and an int8 cache (with bf16 weights the weights' bytes cap what a smaller cache can gain: at 16k tokens of
  Qwen3-0.6B an int8 cache reads 0.70x the bytes a step of a bf16 one reads, with int4 weights 0.59x);
- llama.cpp (llama-cpp-python, built as bench/bench_llamacpp.py's docstring says, on llamacpp_peer.py's GGUF files) on
  the bf16 GGUF with an f16 cache and with a q8_0 cache, and on the q4_0 GGUF with a q8_0 cache.

At each length L, a system processes a fresh prompt of L tokens (nanoqwen: generate 1 token, its default chunked
prefill of 2048-token steps; llama.cpp: one `eval`, batch 512), then decodes 32 tokens after it (nanoqwen: a
generate of 33 tokens minus one of 1 on the same prompt, both served from its prefix cache; llama.cpp: 32 one-token
`eval` calls). Each figure is the best of --repeats. The decode bound is the read bandwidth (bench_llamacpp's
ReadBandwidth: the higher of its two readings, just before the timing) over the bytes one step reads: the weights
(nanoqwen: every matrix once; llama.cpp: the file's tensors) and the keys and values of the L + 16 positions (on
average) it attends to.

    python bench/bench_long_context.py --prompt-attention [--lengths 2048 16384]

times instead one layer's attention of the last prompt chunk (nanoqwen's bf16 kernel, prefill_attention_bf16:
PREFILL_CHUNK queries after L - PREFILL_CHUNK cached positions, the model's heads) beside a bf16 matmul of
bench_model's PEAK_SIZE: how near prompt attention at L runs to the matrix products' pace, which sets how
a long prompt's rate compares with a short one's.

    python bench/bench_long_context.py --lengths 16384 --alternate 8 \
        --systems "nanoqwen int4, cache bf16" "nanoqwen int4, cache int8"

loads the named nanoqwen systems in one process and, at each length, prefills the prompt in each, then times their
decodes taking turns, --alternate rounds: each system's median and, against the first, the median of the rounds'
speed ratios with their quartiles. Run one after the other, systems can meet the machine in different states (on
some hosts the read bandwidth moves by a fifth between minutes); taking turns compares them on the same one.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_llamacpp  # noqa: E402  (its bandwidth reading)
import bench_model  # noqa: E402  (its checkpoint, bandwidth and BENCHMARKS.md writer)
import llamacpp_peer  # noqa: E402  (llama.cpp's GGUF files and build)

DECODE_TOKENS = 32
SYSTEMS = {  # name: (engine, weights, cache)
    "nanoqwen bf16, cache bf16": ("nanoqwen", None, "auto"),
    "nanoqwen bf16, cache int8": ("nanoqwen", None, "int8"),
    "nanoqwen bf16, cache fp8_e4m3": ("nanoqwen", None, "fp8_e4m3"),
    "nanoqwen int4, cache bf16": ("nanoqwen", "int4", "auto"),
    "nanoqwen int4, cache int8": ("nanoqwen", "int4", "int8"),
    "llama.cpp bf16, cache f16": ("llama", "bf16", "f16"),
    "llama.cpp bf16, cache q8_0": ("llama", "bf16", "q8_0"),
    "llama.cpp q4_0, cache q8_0": ("llama", "q4_0", "q8_0"),
}
# bytes a cached value takes: llama.cpp's q8_0 holds 32 values in 34 bytes
LLAMA_CACHE_BYTES = {"f16": 2.0, "q8_0": 34 / 32}
PREFILL_CHUNK = 2048  # the engine's default prompt step (max_num_batched_tokens)


def prompt_attention(model_dir: Path, lengths: list[int], repeats: int) -> None:
    """--prompt-attention: for each length L, ms and GFLOP/s of one layer's attention of a PREFILL_CHUNK-query
    chunk after L - PREFILL_CHUNK positions (min(L, PREFILL_CHUNK) queries, none cached, for short L), its keys and
    values views of a [L, kv heads, D] tensor as the paged cache holds them; then a bf16 PEAK_SIZE^3 matmul's rate
    (bench_model.square_matmul_tops).
    The FLOPs count the visible keys only (query i of the chunk sees num_cached + i + 1): 2 * D for its scores and
    2 * D for its weighted sums, each query head."""
    import torch

    from nanoqwen.attention.backends.cpu_prefill import prefill_attention_bf16

    config = json.loads((model_dir / "config.json").read_text())
    hq, hkv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or config["hidden_size"] // hq
    torch.manual_seed(0)
    for length in lengths:
        t = min(length, PREFILL_CHUNK)
        cached = length - t
        q = torch.randn(hq, t, d).bfloat16()
        k = torch.randn(length, hkv, d).bfloat16().transpose(0, 1)  # [Hkv, L, D] views of the cache's layout
        v = torch.randn(length, hkv, d).bfloat16().transpose(0, 1)
        prefill_attention_bf16(q, k, v, cached)  # warm-up
        seconds = bench_model.best_of(lambda q=q, k=k, v=v, n=cached: prefill_attention_bf16(q, k, v, n), repeats)
        flops = 4 * hq * d * (t * cached + t * (t + 1) // 2)
        print(f"prompt attention at {length:,}: {t} queries after {cached:,} positions, one layer "
              f"({hq} query / {hkv} kv heads of {d}): {seconds * 1e3:.0f} ms, {flops / seconds / 1e9:.0f} GFLOP/s")
    tflops = bench_model.square_matmul_tops(torch.bfloat16, max(repeats, 3))
    print(f"bf16 matmul {bench_model.PEAK_SIZE}^3: {tflops * 1e3:.0f} GFLOP/s")


def alternate(model_dir: Path, systems: list[str], lengths: list[int], rounds: int) -> str:
    """--alternate: the nanoqwen systems in this process, their decodes at each length taking turns; a table."""
    import statistics

    max_len = max(lengths) + DECODE_TOKENS + 16
    loaded = {}
    for system in systems:
        _, weights, cache = SYSTEMS[system]
        print(f"loading {system} ...", file=sys.stderr, flush=True)
        loaded[system] = load_nanoqwen(str(model_dir), weights, cache, max_len)
    for prefill, decode, _ in loaded.values():  # warm-up
        prefill(bench_model.prompts(1, 64)[0])
        decode(bench_model.prompts(1, 64)[0])
    lines = [f"| context | system | decode tok/s (median of {rounds}) | speed against the first (median, quartiles) |",
             "|---|---|---:|---|"]
    for length in lengths:
        prompt = [1000 + (7 * i + length) % 50000 for i in range(length)]
        for system, (prefill, _, _) in loaded.items():
            print(f"prefilling {length:,} tokens in {system}: {prefill(prompt):.0f} s", file=sys.stderr, flush=True)
        times: dict[str, list[float]] = {system: [] for system in loaded}
        for r in range(rounds):
            for system, (_, decode, _) in loaded.items():
                times[system].append(decode(prompt))
            print(f"  round {r + 1}: " + ", ".join(f"{DECODE_TOKENS / t[-1]:.1f}" for t in times.values()),
                  file=sys.stderr, flush=True)
        first = times[systems[0]]
        for system, t in times.items():
            ratios = sorted(a / b for a, b in zip(first, t, strict=True))
            quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
            against = (f"{statistics.median(ratios):.2f}x ({quartiles[0]:.2f}-{quartiles[2]:.2f})"
                       if system != systems[0] else "-")
            lines.append(f"| {length:,} | {system} | {DECODE_TOKENS / statistics.median(t):.1f} | {against} |")
    return "\n".join(lines)


def load_nanoqwen(model_dir: str, quantization: str | None, cache: str, max_len: int):
    """(prefill(prompt) -> s, decode(prompt) -> s, facts) for nanoqwen in this process."""
    import torch

    from nanoqwen import LLM, SamplingParams
    from nanoqwen.attention.kv_cache import KVCache
    from nanoqwen.layers.linear import Linear
    from nanoqwen.quantization import weight_bytes

    c = json.loads((Path(model_dir) / "config.json").read_text())
    per_token = KVCache.bytes_per_token(c["num_hidden_layers"], c["num_key_value_heads"], c["head_dim"],
                                        torch.bfloat16, cache)
    llm = LLM(model_dir, dtype="bfloat16", device="cpu", quantization=quantization, kv_cache_dtype=cache,
              max_model_len=max_len, kv_cache_memory=int(per_token * (max_len + 64) * 1.05))

    def run(prompt: list[int], n: int) -> float:
        start = time.perf_counter()
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        seconds = time.perf_counter() - start
        if len(out[0].outputs[0].token_ids) != n:
            sys.exit(f"nanoqwen made {len(out[0].outputs[0].token_ids)} of {n} tokens")
        return seconds

    def decode(prompt: list[int]) -> float:  # its blocks cached by the prefill before
        return run(prompt, 1 + DECODE_TOKENS) - run(prompt, 1)

    model = llm.llm_engine.model
    weights = sum(weight_bytes(m) for m in model.modules() if isinstance(m, Linear))
    facts = {"step_weight_bytes": weights, "kv_bytes_per_token": per_token, "kernels": llm.llm_engine.kernel_path}
    return lambda prompt: run(prompt, 1), decode, facts


def load_llama(gguf: str, cache: str, max_len: int):
    """As load_nanoqwen, for llama.cpp on one GGUF file with flash attention and a cache of `cache` type."""
    import llama_cpp

    ggml_type = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0}[cache]
    threads = os.cpu_count() or 1
    llm = llama_cpp.Llama(gguf, n_ctx=max_len + 64, n_batch=512, n_ubatch=512, n_threads=threads,
                          n_threads_batch=threads, flash_attn=True, type_k=ggml_type, type_v=ggml_type,
                          verbose=False)
    meta = llm.metadata
    arch = meta["general.architecture"]
    per_token = (2 * int(meta[f"{arch}.block_count"]) * int(meta[f"{arch}.attention.head_count_kv"])
                 * int(meta[f"{arch}.attention.key_length"]) * LLAMA_CACHE_BYTES[cache])

    def prefill(prompt: list[int]) -> float:
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        return time.perf_counter() - start

    def decode(prompt: list[int]) -> float:  # after prefill(prompt): the cache holds it
        start = time.perf_counter()
        for i in range(DECODE_TOKENS):
            llm.eval([1000 + i])
        return time.perf_counter() - start

    facts = {"step_weight_bytes": llamacpp_peer.gguf_tensor_bytes(Path(gguf)), "kv_bytes_per_token": per_token}
    return prefill, decode, facts


def child(system: str, model: str, lengths: list[int], repeats: int) -> None:
    """Time one system at every length; print one JSON line of results."""
    engine, weights, cache = SYSTEMS[system]
    max_len = max(lengths) + DECODE_TOKENS + 16
    if engine == "nanoqwen":
        prefill, decode, facts = load_nanoqwen(model, weights, cache, max_len)
    else:
        prefill, decode, facts = load_llama(model, cache, max_len)
    bandwidth = bench_llamacpp.ReadBandwidth()
    rows = []
    prefill(bench_model.prompts(1, 64)[0])  # warm-up
    decode(bench_model.prompts(1, 64)[0])
    for length in lengths:
        best_prefill = best_decode = float("inf")
        read = 0.0
        for r in range(repeats):
            prompt = [1000 + (7 * i + 13 * r + length) % 50000 for i in range(length)]  # fresh: no cache hits
            best_prefill = min(best_prefill, prefill(prompt))
            read = max(read, *(x for x in bandwidth() if x is not None))
            best_decode = min(best_decode, decode(prompt))
        step_bytes = facts["step_weight_bytes"] + facts["kv_bytes_per_token"] * (length + DECODE_TOKENS / 2)
        rows.append({"length": length, "prefill_tok_s": length / best_prefill,
                     "decode_tok_s": DECODE_TOKENS / best_decode, "bound_tok_s": read * 1e9 / step_bytes,
                     "bandwidth_gb_s": read, "step_bytes": step_bytes})
    facts["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("RESULT " + json.dumps({"facts": facts, "rows": rows}), flush=True)


def run_child(system: str, model: str, lengths: list[int], repeats: int, env: dict) -> dict | None:
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.run([sys.executable, __file__, "--child", system, "--model", model, "--repeats",
                               str(repeats), "--lengths", *map(str, lengths)],
                              stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
        err.seek(0)
        print(f"{system} failed:\n{err.read()[-3000:]}", file=sys.stderr)
        return None


def table(results: dict[str, dict], lengths: list[int]) -> str:
    lines = ["| context | system | prefill tok/s | decode tok/s | decode bound tok/s | of bound | KV bytes a token |",
             "|---|---|---|---|---|---|---|"]
    for length in lengths:
        for system, result in results.items():
            row = next(r for r in result["rows"] if r["length"] == length)
            lines.append(f"| {length:,} | {system} | {row['prefill_tok_s']:.0f} | {row['decode_tok_s']:.1f} | "
                         f"{row['bound_tok_s']:.1f} | {row['decode_tok_s'] / row['bound_tok_s']:.0%} | "
                         f"{result['facts']['kv_bytes_per_token'] / 1024:.1f} KiB |")
    lines += ["", "Peak memory of each system's process (resident, all lengths): " + "; ".join(
        f"{system} {result['facts']['peak_rss_bytes'] / 2**30:.2f} GiB" for system, result in results.items()) + "."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: bench_model's random Qwen3-0.6B)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--repeats", type=int, default=2, help="timings per figure (the best counts)")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS), metavar="SYSTEM")
    parser.add_argument("--write", action="store_true", help="record the table in BENCHMARKS.md")
    parser.add_argument("--prompt-attention", action="store_true",
                        help="time one layer's attention of the last prompt chunk at each length instead (bf16)")
    parser.add_argument("--alternate", type=int, default=0, metavar="ROUNDS",
                        help="nanoqwen systems only: all in one process, their decodes taking turns for ROUNDS rounds")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.model, args.lengths, args.repeats)
    model_dir = Path(args.model) if args.model else bench_model.DEFAULT_DIR
    bench_model.ensure_checkpoint(model_dir)
    if args.prompt_attention or args.alternate:  # (printed, for the record, not written to BENCHMARKS.md)
        if args.write:
            sys.exit("--write records the standard run's table; --prompt-attention and --alternate print theirs")
        others = [s for s in args.systems if SYSTEMS[s][0] != "nanoqwen"]
        if args.alternate and (others or len(args.systems) < 2):
            sys.exit("--alternate compares two or more nanoqwen systems in one process: name them with --systems"
                     + (f" (llama.cpp's run in processes of their own: {', '.join(others)})" if others else ""))
        print(f"`{bench_model.command_line('bench_long_context.py', sys.argv[1:])}`, {os.cpu_count()} threads\n\n"
              f"{bench_model.machine_line('cpu')}\n", flush=True)
        if args.prompt_attention:
            return prompt_attention(model_dir, args.lengths, args.repeats)
        print(alternate(model_dir, args.systems, args.lengths, args.alternate))
        return None
    llama_wanted = any(SYSTEMS[s][0] == "llama" for s in args.systems)
    files = {}
    if llama_wanted:
        llamacpp_peer.import_llama_cpp("; or leave the llama.cpp systems out with --systems")
        files = llamacpp_peer.gguf_files(model_dir)
    results = {}
    for system in args.systems:
        engine, weights, _ = SYSTEMS[system]
        model = str(model_dir) if engine == "nanoqwen" else str(files[weights])
        print(f"timing {system} ...", file=sys.stderr, flush=True)
        result = run_child(system, model, args.lengths, args.repeats, dict(os.environ))
        if result is not None:
            results[system] = result
            print(json.dumps(result), file=sys.stderr)
    if not results:
        sys.exit("no system ran")
    instructions = llamacpp_peer.llama_instructions() if llama_wanted else []
    body = (f"### Long contexts: nanoqwen's KV cache types vs llama.cpp's, CPU\n\n"
            f"`{bench_model.command_line('bench_long_context.py', sys.argv[1:])}` on "
            f"{'a random checkpoint with the exact Qwen3-0.6B shape' if not args.model else model_dir.name}; "
            f"llama.cpp (flash attention on) built for: {' '.join(instructions) or '-'}. "
            f"{os.cpu_count()} threads; the best of {args.repeats} timings; the decode bound as the script's "
            "docstring says (weights and the cached keys and values read once a step).\n\n"
            f"{bench_model.machine_line('cpu')}\n\n" + table(results, args.lengths))
    print(body)
    if args.write:
        bench_model.write_benchmarks(bench_model.section_name("bench_long_context", "cpu"), body)


if __name__ == "__main__":
    main()
