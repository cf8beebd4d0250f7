"""Batched decode on a CPU against its roofline: nanoqwen's decode tok/s at batch 1 to 64 for bf16, int8 and int4
weights, beside what the machine allows.

    python bench/bench_batch_decode.py                        # random checkpoint with the exact Qwen3-0.6B shape
    python bench/bench_batch_decode.py --write                # also record the table in BENCHMARKS.md
    python bench/bench_batch_decode.py --batches 1,16 --formats int4
    python bench/bench_batch_decode.py --baseline-env NANOQWEN_CPU_AMX=0   # each format also without AMX tiles
    python bench/bench_batch_decode.py --amx-ab        # int4 without and with AMX tiles, alternating in one process
    python bench/bench_batch_decode.py --llama         # also llama.cpp's batched decode on the same weights

Each format runs in its own subprocess on the same checkpoint (bench_model.py's random Qwen3-0.6B one), the same
token ids and the same procedure: B prompts of PROMPT_LEN tokens, a generate call with 1 new token each and one with
1 + N (greedy, EOS ignored); B * N / (difference) is the decode rate. Best of --repeats. With --llama, llama.cpp
decodes the same B prompts on the same weights as GGUF files (llamacpp_peer.py makes them; bench_llamacpp.py says how
to build llama-cpp-python; bf16, q8_0 and q4_0 beside bf16, int8 and int4), B sequences in one context, N greedy steps
after the prompts' pass (llamacpp_peer.LlamaBatchDecode), in a process of its own after each nanoqwen format.

The two bounds of a decode step of B rows, measured in the same run:
- reading the weights once a step: B * read bandwidth / (bytes of the projections and the LM head), the read
  bandwidth a torch sum over 1 GiB (bench_model.read_bandwidth);
- the matrix unit's peak: (measured multiply-add rate) / (2 * weights a token), the rate of a large torch product,
  bf16 (oneDNN; AMX bf16 tiles where the CPU has them) or float32, the faster, for bf16 and int8 weights (int8
  widens exactly to either; a CPU without bf16 instructions computes many rows in float32); for int4 weights, whose
  kernels quantise x to int8, the fastest of those, int8 x int8 -> int32 (torch._int_mm) and the vector unit's
  int8 dot products alone (INT8_PEAK_SOURCE: torch's int8 product is far below them on an AVX2-only CPU).
The roofline is the lower of the two; "of roofline" is the measured rate's share of it.

Beside each row, a step's matrix products alone (products_ms: every projection and the LM head once on B rows,
through the model's modules): their time and its share of the measured step, and their rate against the matrix
unit's peak. Where the step is far from its roofline they say whether the kernels or the rest of the step is why.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_model  # noqa: E402
import llamacpp_peer  # noqa: E402  (llama.cpp's GGUF files, build and batched decode)

FORMATS = ("bf16", "int8", "int4")
BATCHES = (1, 2, 4, 8, 16, 32, 64)
PROMPT_LEN = 16
LLAMA_TYPES = {"bf16": "bf16", "int8": "q8_0", "int4": "q4_0"}  # the GGUF type beside each format


# The int8 dot products of the int4 kernels at their peak, with nothing else: 8 independent chains of u8 x s8 products
# of the vectors the kernels use for many rows, summed into int32 lanes with AVX-512 VNNI (vpdpbusd on 64-byte vectors,
# as int4_gemm.cpp's panels; 32-byte ones where only the 256-bit form is built), or into int16 ones with AVX2 alone
# (maddubs, then an add: what the kernels do per product at least). Returns multiply-adds a second over all threads.
INT8_PEAK_SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <chrono>
#include <cstdint>
#include <cstring>
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
typedef __m512i Vec;
#define PRODUCT "vpdpbusd %3, %2, %0"
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
typedef __m256i Vec;
#define PRODUCT "vpdpbusd %3, %2, %0"
#else
typedef __m256i Vec;
#define PRODUCT "vpmaddubsw %3, %2, %1\n\tvpaddw %1, %0, %0"
#endif
double int8_dot_peak(int64_t iters) {
  double total = 0;
#pragma omp parallel reduction(+ : total)
  {
    Vec w, x, a[8], t;
    std::memset(&w, 3, sizeof w);
    std::memset(&x, 5, sizeof x);
    std::memset(a, 0, sizeof a);
    auto start = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < iters; ++i) {
#define STEP(j) asm volatile(PRODUCT : "+v"(a[j]), "=&v"(t) : "v"(w), "v"(x));
      STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5) STEP(6) STEP(7)
    }
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    total += 8.0 * sizeof(Vec) * iters / seconds;  // (asm volatile: the products run though nothing reads a)
  }
  return total;
}
"""


def int8_dot_peak() -> float:
    """INT8_PEAK_SOURCE's rate, TOP/s (2 operations a multiply-add), compiled with the flags of nanoqwen's kernels."""
    from torch.utils import cpp_extension

    from nanoqwen.ops.cpu import build as cpu_build

    flags = cpu_build.compile_flags()
    name = "nanoqwen_bench_int8_peak_" + "_".join(f.strip("-") for f in flags if "avx" in f)
    ext = cpp_extension.load_inline(name, cpp_sources=[INT8_PEAK_SOURCE], functions=["int8_dot_peak"],
                                    extra_cflags=flags, extra_ldflags=["-fopenmp"])
    ext.int8_dot_peak(1 << 20)
    return 2 * max(ext.int8_dot_peak(1 << 24) for _ in range(3)) / 1e12


def peaks() -> dict:
    """The machine's bounds: read GB/s, bf16, float32 and int8 matmul TOP/s (best of five after a warm-up; one where
    a product takes seconds, as bf16 does on a CPU without bf16 instructions)."""
    import torch

    read = bench_model.read_bandwidth()
    bf16, float32 = bench_model.square_matmul_tops(torch.bfloat16), bench_model.square_matmul_tops(torch.float32)
    int8 = bench_model.square_matmul_tops(torch.int8)
    return {"read_gb_s": read, "bf16_tflop_s": bf16, "float32_tflop_s": float32, "int8_tops": int8,
            "int8_dot_tops": int8_dot_peak()}


def set_int4_amx(model, rows: int) -> None:
    """int4 products of `rows` or more rows on AMX tiles (0: never) in this process: the layers' MatmulPath and the
    one-call decode step's setting."""
    from nanoqwen.ops.cpu import kernels as cpu_kernels
    from nanoqwen.ops.cpu.matmul import MatmulPath

    cpu_kernels.set_int4_amx_min_rows(rows)
    for module in model.modules():
        path = getattr(module, "matmul_path", None)
        if isinstance(path, MatmulPath):
            module.matmul_path = dataclasses.replace(path, int4_amx_min_rows=rows)


def int4_projections_ms(model, batches: list[int], repeats: int) -> dict[int, tuple[float, float]]:
    """For each batch, ms a decode step's int4 products take (every int4 layer of the model once, B rows of x), through
    int4_gemv without AMX tiles and through int4_amx: best of 2 * repeats + 1 rounds, the two alternating."""
    import torch

    from nanoqwen.ops.cpu import kernels as cpu_kernels
    from nanoqwen.quantization.int4 import Int4Linear

    layers = [m for m in model.modules() if isinstance(m, Int4Linear)]
    times = {}
    for batch in batches:
        xs = {m.in_features: torch.randn(batch, m.in_features).bfloat16() for m in layers}

        def step(kernel, xs: dict = xs) -> None:
            for m in layers:
                kernel(xs[m.in_features], m.weight, m.scale, m.offset, *m.supers())

        best = {kernel: float("inf") for kernel in (cpu_kernels.int4_gemv, cpu_kernels.int4_amx)}
        for kernel in best:
            step(kernel)
        for _ in range(2 * repeats + 1):
            for kernel in best:
                start = time.perf_counter()
                step(kernel)
                best[kernel] = min(best[kernel], time.perf_counter() - start)
        times[batch] = tuple(1e3 * t for t in best.values())
        print(f"  int4 products at {batch} rows: {times[batch][0]:.1f} ms, on AMX tiles {times[batch][1]:.1f} ms",
              file=sys.stderr, flush=True)
    return times


def products_ms(matrices: list, batch: int, repeats: int) -> float:
    """ms a decode step's matrix products of `batch` rows take alone: every projection and the LM head once, through
    the modules (so the kernels the engine takes for that many rows), on random bf16 x; best of 2 * repeats + 1.
    Beside the step's time it says how much of the step the products are, and beside the matrix unit's peak how
    near the kernels run to it."""
    import torch

    xs = {}
    for m in matrices:
        k = getattr(m, "in_features", None) or m.weight.shape[1]
        xs.setdefault(k, torch.randn(batch, k).bfloat16())

    calls = [(m, xs[getattr(m, "in_features", None) or m.weight.shape[1]]) for m in matrices]

    def step() -> None:
        with torch.inference_mode():
            for m, x in calls:
                m(x)

    step()
    return 1e3 * bench_model.best_of(step, 2 * repeats + 1)


def run_format(model_dir: str, fmt: str, batches: list[int], tokens: int, repeats: int, amx_ab: bool = False) -> dict:
    """tok/s for each batch of one format, and the model's bytes read a step and weights a token. amx_ab (int4 on a
    CPU with AMX tiles): each timing alternates a run without the tiles and one with them from 2 rows on, in this
    process on this model, so that both see the same machine; "tok_s" then holds the runs with them and
    "tok_s_without_amx" the others."""
    from nanoqwen import LLM, SamplingParams
    from nanoqwen.layers.linear import Linear
    from nanoqwen.ops.cpu import kernels as cpu_kernels
    from nanoqwen.quantization import weight_bytes

    llm = LLM(model_dir, dtype="bfloat16", device="cpu", max_model_len=PROMPT_LEN + tokens + 8,
              max_num_seqs=max(batches), max_num_batched_tokens=max(2048, PROMPT_LEN * max(batches)),
              enable_prefix_caching=False, quantization=None if fmt == "bf16" else fmt)
    model = llm.llm_engine.model
    matrices = [m for m in model.modules() if isinstance(m, Linear)]
    result = {"read_bytes": sum(weight_bytes(m) for m in matrices),
              "params": sum(map(bench_model.params, matrices)),
              "kernel_path": llm.llm_engine.kernel_path, "tok_s": {}}

    def gen(batch: list[list[int]], n: int):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        return lambda: llm.generate(batch, params, use_tqdm=False)

    variants = {"tok_s": None}
    if amx_ab and fmt == "int4" and cpu_kernels.amx_int8_available():
        variants = {"tok_s_without_amx": 0, "tok_s": 2}
        result["tok_s_without_amx"] = {}
        result["projections_ms"] = int4_projections_ms(model, batches, repeats)
    for batch in batches:
        p = bench_model.prompts(batch, PROMPT_LEN)
        gen(p, 2)()  # warm-up
        first, full = dict.fromkeys(variants, float("inf")), dict.fromkeys(variants, float("inf"))
        for _ in range(repeats):
            for key, rows in variants.items():
                if rows is not None:
                    set_int4_amx(model, rows)
                first[key] = min(first[key], bench_model.best_of(gen(p, 1), 1))
                full[key] = min(full[key], bench_model.best_of(gen(p, 1 + tokens), 1))
        for key in variants:
            result[key][batch] = batch * tokens / (full[key] - first[key])
        result.setdefault("products_ms", {})[batch] = products_ms(matrices, batch, repeats)
        shown = ", ".join(f"{key} {result[key][batch]:.1f}" for key in variants)
        print(f"  {fmt} batch {batch}: {shown}; products alone {result['products_ms'][batch]:.1f} ms", file=sys.stderr,
              flush=True)
    return result


def run_llama(model_dir: Path, gguf_type: str, batches: list[int], tokens: int, repeats: int) -> dict:
    """As run_format, for llama.cpp on the checkpoint's GGUF file of `gguf_type` (llamacpp_peer.gguf_files): tok/s
    for each batch and the file's tensor bytes (what a step reads)."""
    gguf = llamacpp_peer.gguf_files(model_dir, (gguf_type,))[gguf_type]
    decode = llamacpp_peer.LlamaBatchDecode(str(gguf), tokens)
    result = {"read_bytes": llamacpp_peer.gguf_tensor_bytes(gguf), "tok_s": {}}
    for batch in batches:
        p = bench_model.prompts(batch, PROMPT_LEN)
        decode(p)  # warm-up
        result["tok_s"][batch] = batch * tokens / min(decode(p) for _ in range(repeats))
        print(f"  llama.cpp {gguf_type} batch {batch}: {result['tok_s'][batch]:.1f}", file=sys.stderr, flush=True)
    decode.close()
    return result


def child(what: str, args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    if what == "peaks":
        result = peaks()
    elif what.startswith("llama.cpp "):
        result = run_llama(Path(args.model), what.split()[1], batches, args.tokens, args.repeats)
    else:
        result = run_format(args.model, what, batches, args.tokens, args.repeats, args.amx_ab)
    print("RESULT " + json.dumps(result))


def run_child(what: str, args: argparse.Namespace, env: dict[str, str] | None = None) -> dict:
    cmd = [sys.executable, __file__, "--child", what, "--model", str(args.model), "--batches", args.batches,
           "--tokens", str(args.tokens), "--repeats", str(args.repeats), "--threads", str(args.threads)]
    cmd += ["--amx-ab"] if args.amx_ab else []
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        sys.exit(f"{what} benchmark failed (exit {proc.returncode})")
    return json.loads(line[len("RESULT "):])


def matrix_unit_peak(fmt: str, ceil: dict) -> float:
    """The fastest product a format's batched kernels can use, TOP/s: the bf16 or float32 one (a CPU without fast
    bf16 widens 16-bit and int8 weights to float32 for many rows), and for int4 also int8 x int8 (torch's product, or
    the vector unit's dot products at their peak, INT8_PEAK_SOURCE, where torch's is slower)."""
    fastest = max(ceil["bf16_tflop_s"], ceil.get("float32_tflop_s", 0.0))
    return max(fastest, ceil["int8_tops"], ceil.get("int8_dot_tops", 0.0)) if fmt == "int4" else fastest


def table(results: dict[str, dict], ceil: dict) -> str:
    """One row per format (and run: "int4 NANOQWEN_CPU_AMX=0" a --baseline-env one; "llama.cpp q4_0" llama.cpp's, with
    its "peak_format") and batch: tok/s, both bounds, the roofline's share, the products alone (nanoqwen's)."""
    lines = ["| weights | batch | tok/s | weights-once bound | matrix-unit bound | of roofline | products alone, ms "
             "(of the step) | products of matrix-unit peak |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        fmt = r.get("peak_format", name.split()[0])
        peak = matrix_unit_peak(fmt, ceil) * 1e12
        compute = peak / (2 * r["params"])
        runs = [(name, r["tok_s"])]
        if "tok_s_without_amx" in r:
            runs = [(f"{name}, no AMX tiles", r["tok_s_without_amx"]), (f"{name}, AMX tiles", r["tok_s"])]
        for batch in r["tok_s"]:
            read = int(batch) * ceil["read_gb_s"] * 1e9 / r["read_bytes"]
            roof = min(read, compute)
            products = " | "
            if batch in r.get("products_ms", {}):  # the default run's products (the last of `runs`)
                ms = r["products_ms"][batch]
                products = (f"{ms:.1f} ({ms / (1e3 * int(batch) / r['tok_s'][batch]):.0%}) | "
                            f"{2 * r['params'] * int(batch) / (ms / 1e3) / peak:.0%}")
            for i, (label, rates) in enumerate(runs):
                rate = rates[batch]
                shown = products if i == len(runs) - 1 else " | "
                lines.append(f"| {label} | {batch} | {rate:.1f} | {read:.0f} | {compute:.0f} | {rate / roof:.0%} | "
                             f"{shown} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help=f"model folder (default: a random one in "
                                                      f"{bench_model.DEFAULT_DIR})")
    parser.add_argument("--formats", default=",".join(FORMATS), help="weights: bf16, int8, int4, comma-separated")
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)), help="batch sizes, comma-separated")
    parser.add_argument("--tokens", type=int, default=16, help="new tokens a sequence decodes (after the first)")
    parser.add_argument("--repeats", type=int, default=3, help="best of N timings")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch's threads (default: all)")
    parser.add_argument("--write", action="store_true", help="record the table in BENCHMARKS.md")
    parser.add_argument("--baseline-env", default=None, metavar="NAME=VALUE",
                        help="also run each format with this environment variable set, just before its default run "
                             "(e.g. NANOQWEN_CPU_AMX=0: without AMX tiles), as rows of their own")
    parser.add_argument("--amx-ab", action="store_true",
                        help="int4 on a CPU with AMX tiles: time each batch without and with the tiles, alternating "
                             "in one process (rows of their own)")
    parser.add_argument("--llama", action="store_true",
                        help="also llama.cpp's batched decode on the same weights (GGUF bf16, q8_0, q4_0; needs "
                             "llama-cpp-python, as bench_llamacpp.py's docstring says)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args)
    formats = [f for f in args.formats.split(",") if f]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        sys.exit(f"--formats: {', '.join(unknown)} is not one of {', '.join(FORMATS)}")
    model_dir = Path(args.model) if args.model else bench_model.DEFAULT_DIR
    bench_model.ensure_checkpoint(model_dir)
    llama_cpp_version = None
    if args.llama:
        llama_cpp_version = llamacpp_peer.import_llama_cpp("; or leave out --llama").__version__
        llamacpp_peer.gguf_files(model_dir, tuple(LLAMA_TYPES[f] for f in formats))  # (made once)
    args.model_given, args.model = args.model is not None, str(model_dir)
    start = time.perf_counter()
    ceil = run_child("peaks", args)
    print(f"peaks: {json.dumps(ceil)}", file=sys.stderr, flush=True)
    baseline = None
    if args.baseline_env:
        name, eq, value = args.baseline_env.partition("=")
        if not eq or not name:
            sys.exit(f"--baseline-env {args.baseline_env!r}: give NAME=VALUE, e.g. NANOQWEN_CPU_AMX=0")
        baseline = {name: value}
    results = {}
    for fmt in formats:
        if baseline:
            print(f"running {fmt} with {args.baseline_env} ...", file=sys.stderr, flush=True)
            results[f"{fmt} {args.baseline_env}"] = run_child(fmt, args, baseline)
        print(f"running {fmt} ...", file=sys.stderr, flush=True)
        results[fmt] = run_child(fmt, args)
        if args.llama:
            peer = f"llama.cpp {LLAMA_TYPES[fmt]}"
            print(f"running {peer} ...", file=sys.stderr, flush=True)
            # the same model (weights a token), and the matrix unit its kernels use: bf16 dot products for bf16,
            # int8 ones (x quantised to q8_0) for q8_0 and q4_0
            results[peer] = {**run_child(peer, args), "params": results[fmt]["params"],
                             "peak_format": "bf16" if fmt == "bf16" else "int4"}
    name = "a random checkpoint with the exact Qwen3-0.6B shape" if not args.model_given else model_dir.name
    peers = ""
    if args.llama:
        peers = (f". llama.cpp (llama-cpp-python {llama_cpp_version}, built for: "
                 f"{' '.join(llamacpp_peer.llama_instructions()) or '-'}): the same prompts on GGUF files of the "
                 "same weights, B sequences in one context (n_seq_max B, flash attention on), greedy steps after the "
                 "prompts' pass; its rows' weights-once bound is over the file's tensor bytes, its matrix-unit bound "
                 "bf16's (bf16 file) or the int8 one (q8_0, q4_0: int8 dot products)")
    body = (f"### Batched decode against the roofline ({', '.join(formats)} weights)\n\n"
            f"`{bench_model.command_line('bench_batch_decode.py', sys.argv[1:])}` on "
            f"{name}"
            f": B prompts of {PROMPT_LEN} tokens, {args.tokens} new tokens each (greedy, EOS ignored), best of "
            f"{args.repeats}, {args.threads} threads. Weights-once bound: B x read bandwidth "
            f"({ceil['read_gb_s']:.1f} GB/s, a torch sum over "
            f"1 GiB) / bytes of the projections and LM head; matrix-unit bound: the measured peak of a "
            f"{bench_model.PEAK_SIZE}^3 product (bf16: {ceil['bf16_tflop_s']:.2f}, float32: "
            f"{ceil['float32_tflop_s']:.2f} TFLOP/s, the faster for bf16 and int8 weights; for int4 weights, whose "
            f"kernels quantise x to int8, the faster of those and int8 x int8 torch._int_mm: {ceil['int8_tops']:.2f} "
            f"TOP/s, and the vector unit's int8 dot products alone: {ceil['int8_dot_tops']:.2f} TOP/s) / 2 x weights "
            f"a token. Kernels: {results[formats[0]]['kernel_path']}{peers}\n\n"
            f"{bench_model.machine_line('cpu')}\n\n" + table(results, ceil))
    for r in results.values():
        if "projections_ms" in r:
            body += ("\n\nA decode step's int4 products alone (every int4 layer once, B rows; best of "
                     f"{2 * args.repeats + 1}, alternating): ms without and with AMX tiles\n\n"
                     "| batch | int4_gemv (no tiles) | int4_amx (tiles) | speed-up |\n|---:|---:|---:|---:|\n")
            body += "\n".join(f"| {b} | {t[0]:.1f} | {t[1]:.1f} | {t[0] / t[1]:.2f}x |"
                               for b, t in r["projections_ms"].items())
    print(body)
    print(f"({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    if args.write:
        bench_model.write_benchmarks(bench_model.section_name("bench_batch_decode", "cpu"), body)


if __name__ == "__main__":
    main()
