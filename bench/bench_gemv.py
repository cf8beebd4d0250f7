"""Matrix-vector speed on CPU: torch's bf16 F.linear and int8 `_weight_int8pack_mm` against nanoqwen's
bf16_gemv, int8_gemv, int4_gemv and fp8_gemv (nanoqwen/ops/cpu/kernels.py), on Qwen3-0.6B's weight shapes, at 1 and 4
rows of x.

    python bench/bench_gemv.py                 # 2 threads
    python bench/bench_gemv.py --threads 1 --rows 1 2 4 8

Each cell is GB/s of weights read (weight bytes / time; int8 weights are half the bytes of bf16), the time of one
call (the median over calls, best of three interleaved rounds; int4: packed weights, scales and offsets, 4.5 bits a
weight; fp8: e4m3 weights and their float32 scale per row and 128 inputs), and the share of "read (sum)": torch
summing a float32 tensor of the bf16 weight's bytes, timed in the same rounds, i.e. the read bandwidth at that
moment and size. Each call reads a different copy of the weight, cycling through copies that together exceed the L3
cache several times, so the weights come from memory as in a decode step. The read bandwidth of a 1 GiB sum is
printed before and after the table (a shared machine's bandwidth drifts; the two show by how much).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from nanoqwen.ops.cpu import kernels as cpu_kernels
from nanoqwen.ops.quantize import quantize_int4

# Qwen3-0.6B: (name, out features N, in features K)
SHAPES = [("qkv", 4096, 1024), ("o_proj", 1024, 2048), ("gate_up", 6144, 1024), ("down", 1024, 3072),
          ("lm_head", 151936, 1024)]
WORKING_SET = 256 << 20  # bytes of weight copies cycled through (the L3 here is 32 MiB)
MIN_SECONDS = 0.6  # per measurement, split over ROUNDS interleaved rounds (the best round counts)
ROUNDS = 3


def read_bandwidth(gib: int = 1, repeats: int = 5) -> float:
    t = torch.ones(gib << 28)  # float32: 4 bytes each
    t.sum()
    best = min(_time(t.sum) for _ in range(repeats))
    return t.numel() * 4 / best / 1e9


def nbytes(weight: torch.Tensor | tuple[torch.Tensor, ...]) -> int:
    return sum(t.nbytes for t in weight) if isinstance(weight, tuple) else weight.nbytes


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(fn, args_list: list[tuple], seconds: float) -> float:
    """Median seconds of fn(*args), cycling through args_list, for about `seconds` after a warm-up."""
    for args in args_list[:2]:
        fn(*args)
    times: list[float] = []
    total, i = 0.0, 0
    while total < seconds or len(times) < 5:
        args = args_list[i % len(args_list)]
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
        total += times[-1]
        i += 1
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES], help="subset of the shape names")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    ok = cpu_kernels.available()
    print(f"cpu_kernels available: {ok} (build or load {time.perf_counter() - start:.1f} s)")
    print(f"torch {torch.__version__}, {args.threads} threads; read bandwidth (sum of 1 GiB float32): "
          f"{read_bandwidth():.1f} GB/s\n")

    # name -> (which weights it reads, fn(x, weight, scale))
    kernels = {
        "read (sum)": ("float32", lambda x, f, s: f.sum()),
        "torch bf16 F.linear": ("bf16", lambda x, w, s: F.linear(x, w)),
        "nanoqwen bf16_gemv": ("bf16", lambda x, w, s: cpu_kernels.bf16_gemv(x, w)),
        "torch int8pack_mm": ("int8", lambda x, q, s: torch.ops.aten._weight_int8pack_mm(x, q, s)),
        "nanoqwen int8_gemv": ("int8", lambda x, q, s: cpu_kernels.int8_gemv(x, q, s)),
        "nanoqwen int4_gemv": ("int4", lambda x, q4, s: cpu_kernels.int4_gemv(x, *q4)),
        "nanoqwen fp8_gemv": ("fp8", lambda x, w8, s: cpu_kernels.fp8_gemv(x, *w8)),
    }
    if not ok:
        kernels = {k: v for k, v in kernels.items() if not k.startswith("nanoqwen")}
    print(f"| shape (N x K) | M | {' | '.join(kernels)} |")
    print(f"|---|---:|{'---:|' * len(kernels)}")
    g = torch.Generator().manual_seed(0)
    for name, n, k in SHAPES:
        if name not in args.shapes:
            continue
        copies = max(1, WORKING_SET // (n * k * 2))
        weights = {
            "bf16": [(torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16) for _ in range(copies)],
            "int8": [torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8) for _ in range(copies * 2)],
            "float32": [torch.ones(n * k // 2) for _ in range(copies)],  # as many bytes as the bf16 weight
        }
        int4 = quantize_int4(weights["bf16"][0])
        weights["int4"] = [tuple(t.clone() for t in int4) for _ in range(copies * 3)]
        block_scales = torch.rand(n, -(-k // 128), generator=g) / 100  # Qwen's FP8: a scale per 128 x 128 block
        weights["fp8"] = [(w.to(torch.float8_e4m3fn), block_scales) for w in weights["bf16"] * 2]
        scale = (torch.rand(n, generator=g) / 1000).to(torch.bfloat16)
        for m in args.rows:
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            best = dict.fromkeys(kernels, float("inf"))
            for _ in range(ROUNDS):  # interleaved, so a drift in the machine's bandwidth touches all alike
                for label, (kind, fn) in kernels.items():
                    args_list = [(x, w, scale) for w in weights[kind]]
                    best[label] = min(best[label], measure(fn, args_list, MIN_SECONDS / ROUNDS))
            read = weights["float32"][0].nbytes / best["read (sum)"] / 1e9
            cells = []
            for label, (kind, _) in kernels.items():
                gbs = nbytes(weights[kind][0]) / best[label] / 1e9
                share = "" if label == "read (sum)" else f", {gbs / read:.0%}"
                cells.append(f"{gbs:.1f} GB/s, {best[label] * 1e3:.3f} ms{share}")
            print(f"| {name} {n}x{k} | {m} | {' | '.join(cells)} |", flush=True)
        del weights
    print(f"\nread bandwidth after the table: {read_bandwidth():.1f} GB/s")


if __name__ == "__main__":
    main()
