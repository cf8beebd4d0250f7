"""Which matmul path a CPU runs 16-bit models on: measured once per machine, not guessed from its
name.

CPUs with native bf16 matrix instructions (AVX-512-BF16, AMX) multiply bf16 matrices as fast as
float32 ones or faster. On the others (AVX2-only: AMD Zen 2/3, most Intel client chips) torch's bf16
matrix-matrix product is many times slower than its float32 one, because every element is converted
in the inner loop. There, the weights stay 16-bit in memory (half the bytes; a matrix-vector
product, one decode row, reads them directly and stays fast) and products over many rows (prompt
chunks, large batches) convert the weights to float32 block by block and multiply in float32:
`upcast_linear`. Prompt attention does the same (ops/attention.py).

Either path computes the same function: bf16 inputs, products accumulated in float32, the output
rounded to bf16 once. Only the order of the float32 additions differs, so greedy tokens agree within
bf16's tolerance.

The choice (`select_matmul_path`): NANOQWEN_CPU_MATMUL=bf16|float32 forces it; otherwise a probe
times a bf16 and a float32 matmul of a prompt-sized shape (about a second, once) and the result is
cached per CPU model, CPU flags, torch version and thread count in
~/.cache/nanoqwen/cpu-matmul.json. A second probe, cached beside it, times nanoqwen's bf16 gemv
kernel against what those rows would take otherwise (torch's F.linear, or upcast_linear) at 1 to 64
rows and sets how many rows (decode steps, short prompt chunks) the gemv kernels take, on any CPU
(NANOQWEN_CPU_GEMV=0|1 forces them off or on). On the float32 path a third, also cached, times
nanoqwen's bf16_gemm against upcast_linear on a prompt-sized product: where it is faster, it takes the rows
past the gemv kernels' (the same arithmetic with the weights converted inside the product). On the bf16
path a fourth times int4 products over many rows both ways: nanoqwen's int4_gemm (integer dot products)
against the weights unpacked to bf16 for torch's matmul, which AMX runs several times faster than int4_gemm's
VNNI instructions; from the row count on which the second wins, int4 prompts take it (int4_unpack_min_rows).
The probes and their cache are ops/cpu_probes.py; this module decides from what they measure.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from nanoqwen.ops import cpu_build, cpu_probes

logger = logging.getLogger("nanoqwen")
PATHS = ("bf16", "float32")
# fewer rows read the 16-bit weights directly (a matrix-vector product is memory-bound)
UPCAST_MIN_ROWS = 16
# up to this many rows, nanoqwen's own kernels (ops/cpu_gemv.py) where they are on and measured faster
GEMV_MAX_ROWS = 64
# int8 rows go through nanoqwen's int8 kernel up to this many, or up to the bf16 kernel's count if more
INT8_GEMV_MIN_ROWS = 16
# The largest float32 copy of a weight block that a product over many rows makes at a time on a CPU (upcast_linear,
# and the int8/int4 layers' unpacking): small enough that the copy is still in the L3 cache when the matmul reads
# it, so that the weights come from memory once, as 16-bit (or 8- or 4-bit) values.
UPCAST_BLOCK_BYTES = 4 << 20
# The gemv kernels take a row count while their bf16 product reaches this share of the path's alternative
# (torch's F.linear; on the float32 path, from UPCAST_MIN_ROWS rows on, upcast_linear): with them
# come the one-call C++ decode step and the int8 kernel, which gain more than that loses (measured with
# the AVX2 limits on an AVX-512 CPU, where torch's one-row bf16 kernel ties with nanoqwen's: int8
# batch-1 decode 13.2 tok/s through torch's int8pack, 31.9 through nanoqwen's kernel; BENCHMARKS.md).
GEMV_MIN_SHARE = 0.8
SLOW_BF16 = 0.5  # bf16 below half of float32's speed: compute in float32


@dataclass
class MatmulPath:
    """How 16-bit matmuls over many rows run on this CPU: "bf16" (torch's own kernel) or "float32"
    (upcast)."""

    path: str
    reason: str  # why, for the log line and `nanoqwen bench`
    bf16_gflops: float | None = None
    float32_gflops: float | None = None
    gemv_max_rows: int = 0  # few rows (decode), up to this many, through ops/cpu_gemv.py's kernels
    gemv_reason: str = ""  # why
    gemm: bool = False  # on the float32 path, more rows through ops/cpu_gemv.py's bf16_gemm, not upcast_linear
    gemm_reason: str = ""  # why
    # on the bf16 path, int4 products over this many rows or more unpack the weights to bf16 for torch's matmul
    # rather than run nanoqwen's int4 kernel (0: never)
    int4_unpack_min_rows: int = 0
    int4_unpack_reason: str = ""  # why

    @property
    def gemv(self) -> bool:
        """Whether nanoqwen's gemv kernels take any rows."""
        return self.gemv_max_rows > 0

    def describe(self) -> str:
        few = f"<= {self.gemv_max_rows} rows: nanoqwen's gemv kernels ({self.gemv_reason}); " if self.gemv else ""
        if self.path == "bf16":
            return f"{few}bf16 matmuls ({self.reason})"
        more = max(UPCAST_MIN_ROWS, self.gemv_max_rows + 1)  # (the rows the gemv kernels leave)
        how = f"nanoqwen's bf16_gemm, {self.gemm_reason}; " if self.gemm else ""
        return f"{few}>= {more} rows: float32 compute from 16-bit weights ({how}{self.reason})"


_in_use = MatmulPath("bf16", "the default")


def matmul_path() -> MatmulPath:
    """The path this process's engine chose (nanoqwen/compilation.py select_kernels sets it)."""
    return _in_use


_gemv_kernels = None  # nanoqwen/ops/cpu_gemv.py, imported once when a path switches the kernels on


def use_matmul_path(path: MatmulPath) -> None:
    global _in_use, _gemv_kernels
    _in_use = path
    if (path.gemv or path.gemm) and _gemv_kernels is None:  # (imported here, not on every decode call)
        from nanoqwen.ops import cpu_gemv

        _gemv_kernels = cpu_gemv


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for x [N, in] on this CPU's path: a few bf16 rows through the gemv kernel (when on),
    many 16-bit rows computed in float32 (on the float32 path: nanoqwen's bf16_gemm where chosen,
    else upcast_linear), everything else torch's own F.linear."""
    rows = x.shape[0]
    # (the kernel choice is process-wide: a GPU engine's tensors, after a CPU engine chose this path, go to torch)
    bf16 = x.dtype == weight.dtype == torch.bfloat16 and x.device.type == "cpu"
    if _in_use.gemv and rows <= _in_use.gemv_max_rows and bf16:
        return _gemv_kernels.bf16_gemv(x, weight, bias)
    if rows >= UPCAST_MIN_ROWS and upcast_16bit(x):
        if own_gemm(x) and bf16 and bias is None:
            return _gemv_kernels.bf16_gemm(x, weight)
        return upcast_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def int8_gemv_rows(x: torch.Tensor) -> bool:
    """Whether an int8 product over x's rows goes through nanoqwen's int8 kernel: the gemv kernels on,
    bf16 x, up to INT8_GEMV_MIN_ROWS rows whatever the bf16 limit, because its alternative for few rows,
    torch's int8pack, was slower at every row count up to 16 (bench/bench_gemv.py, BENCHMARKS.md); up to
    the bf16 kernel's row count where that is higher, because above 16 rows the alternative is to
    dequantise and multiply as bf16 rows are multiplied, which the bf16 kernel was measured against."""
    most = max(INT8_GEMV_MIN_ROWS, _in_use.gemv_max_rows)
    return _in_use.gemv and x.dtype == torch.bfloat16 and x.numel() <= most * x.shape[-1]


def int8_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """nanoqwen's int8 matrix-vector kernel (ops/cpu_gemv.py); call where int8_gemv_rows(x) is True."""
    return _gemv_kernels.int8_gemv(x, q, scale)


def own_gemm(x: torch.Tensor) -> bool:
    """Whether work over bf16 x's many rows goes through nanoqwen's GEMM kernel: the products (bf16_gemm, and
    int8_gemm for the int8 rows int8_gemv_rows leaves: measured faster than dequantising to float32 blocks,
    BENCHMARKS.md) and a prompt chunk's attention (prefill_attention, its two products). Where the GEMM was
    chosen, on the float32 path."""
    return _in_use.gemm and x.dtype == torch.bfloat16 and upcast_16bit(x)


def int8_gemm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """nanoqwen's int8 GEMM (ops/cpu_gemv.py); call where own_gemm(x) is True."""
    return _gemv_kernels.int8_gemm(x, q, scale)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int,
                      block: int) -> torch.Tensor:
    """nanoqwen's prompt attention (ops/cpu_gemv.py) for q [T, Hq, D], k and v [S, Hkv, D]; call where
    own_gemm(q) is True."""
    return _gemv_kernels.prefill_attention(q, k, v, num_cached, q.shape[-1] ** -0.5, block)


def int4_unpacked(x: torch.Tensor) -> bool:
    """Whether an int4 product over bf16 x's rows unpacks the weights to bf16 for torch's matmul
    (quantization/int4.py int4_linear), rather than nanoqwen's int4 kernel: from the row count where that was
    measured faster (select_matmul_path)."""
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    return (0 < _in_use.int4_unpack_min_rows <= rows and x.device.type == "cpu"
            and x.dtype == torch.bfloat16)


def upcast_16bit(x: torch.Tensor) -> bool:
    """Whether a product over x's rows computes in float32 from 16-bit operands (CPU without fast
    bf16)."""
    return (_in_use.path == "float32" and x.device.type == "cpu"
            and x.dtype in (torch.bfloat16, torch.float16))


def select_matmul_path(cache_dir: Path | None = None) -> MatmulPath:
    """This machine's path for 16-bit matmuls over many rows (forced, cached, or measured now and
    cached), and up to how many rows nanoqwen's gemv kernels take: NANOQWEN_CPU_GEMV=1|0 forces them
    on (up to GEMV_MAX_ROWS) or off; otherwise they take every row count of cpu_probes.GEMV_PROBE_ROWS, from 1
    up, at which they read a weight matrix at least GEMV_MIN_SHARE as fast as torch's bf16 F.linear
    (measured once per machine, cached beside the path; on the float32 path, from UPCAST_MIN_ROWS rows
    on, against what those rows would take: bf16_gemm where _select_gemm chose it, else upcast_linear).
    torch's few-row kernel is far below the read bandwidth on AVX2-only CPUs, and on some native-bf16
    ones too, where its many-row kernel overtakes nanoqwen's at a few rows; a float32 product
    overtakes it at some 100 rows."""
    choice = _select_path(cache_dir)
    wanted = os.environ.get("NANOQWEN_CPU_GEMV", "auto")
    if wanted == "0":
        return choice
    from nanoqwen.ops import cpu_gemv

    if not cpu_gemv.available():
        return choice
    if choice.path == "float32":
        _select_gemm(choice, wanted == "1", cache_dir)
    else:
        _select_int4_unpack(choice, cache_dir)
    if wanted == "1":
        choice.gemv_max_rows = GEMV_MAX_ROWS
        choice.gemv_reason = f"{cpu_gemv.bf16_dot_instructions()}; NANOQWEN_CPU_GEMV=1"
        return choice
    # {rows: [own GB/s, the alternative's GB/s]} (JSON keys are strings)
    # Keyed by the kernels' build too: a changed kernel is measured again.
    against = choice.path + (" + gemm" if choice.gemm else "")
    what = f"gemv rows against the {against} path, kernels {cpu_build.build_digest()}"

    def measure() -> dict:
        return cpu_probes.gemv_probe(choice.path, choice.gemm)

    speeds = {int(m): v for m, v in cpu_probes.cached(cache_dir, what, measure).items()}
    for rows, (own, theirs) in sorted(speeds.items()):
        if own < GEMV_MIN_SHARE * theirs:
            break
        choice.gemv_max_rows = rows
    shown = ", ".join(f"{m}: {own:.1f} vs {theirs:.1f}" for m, (own, theirs) in sorted(speeds.items()))
    choice.gemv_reason = f"{cpu_gemv.bf16_dot_instructions()}; measured GB/s by rows, own vs without them: {shown}"
    return choice


def _select_gemm(choice: MatmulPath, forced: bool, cache_dir: Path | None) -> None:
    """Whether the float32 path's products over many rows go through nanoqwen's bf16_gemm: forced, or
    measured faster than upcast_linear (once per machine and build of the kernels, cached)."""
    if forced:
        choice.gemm, choice.gemm_reason = True, "NANOQWEN_CPU_GEMV=1"
        return
    what = f"gemm against upcast_linear, kernels {cpu_build.build_digest()}"
    speeds = cpu_probes.cached(cache_dir, what, cpu_probes.gemm_probe)
    choice.gemm = speeds["own"] > speeds["upcast"]
    choice.gemm_reason = f"measured {speeds['own']:.0f} vs {speeds['upcast']:.0f} GFLOP/s through upcast_linear"


def _select_int4_unpack(choice: MatmulPath, cache_dir: Path | None) -> None:
    """From how many rows int4 products unpack the weights to bf16 for torch's matmul (bf16 path): the
    smallest row count of cpu_probes.INT4_UNPACK_PROBE_ROWS from which that was measured faster than int4_gemm at every
    count probed (once per machine and build of the kernels, cached); 0 where it never was."""
    what = f"int4 unpacked against int4_gemm, kernels {cpu_build.build_digest()}"
    speeds = {int(m): v for m, v in cpu_probes.cached(cache_dir, what, cpu_probes.int4_unpack_probe).items()}
    choice.int4_unpack_min_rows = 0
    for rows, (gemm, unpacked) in sorted(speeds.items(), reverse=True):
        if unpacked <= gemm:
            break
        choice.int4_unpack_min_rows = rows
    shown = ", ".join(f"{m}: {unpacked:.0f} vs {gemm:.0f}" for m, (gemm, unpacked) in sorted(speeds.items()))
    choice.int4_unpack_reason = f"measured GFLOP/s by rows, unpacked to bf16 vs int4_gemm: {shown}"


def _select_path(cache_dir: Path | None) -> MatmulPath:
    forced = os.environ.get("NANOQWEN_CPU_MATMUL", "auto")
    if forced in PATHS:
        return MatmulPath(forced, "forced by NANOQWEN_CPU_MATMUL")
    if forced != "auto":
        logger.warning("NANOQWEN_CPU_MATMUL=%s is not one of auto, %s: measuring instead",
                       forced, ", ".join(PATHS))
    found = cpu_probes.cached(cache_dir, "matmul", lambda: asdict(probe()))
    return MatmulPath(**{k: v for k, v in found.items() if not k.startswith(("gemv", "gemm", "int4"))})


def probe() -> MatmulPath:
    """Time a bf16 and a float32 matmul of a prompt-sized shape (cpu_probes.PROBE_SHAPE) and choose."""
    bf16, f32 = cpu_probes.matmul_gflops(torch.bfloat16), cpu_probes.matmul_gflops(torch.float32)
    path = "bf16" if bf16 >= SLOW_BF16 * f32 else "float32"
    return MatmulPath(path, f"measured: bf16 {bf16:.1f}, float32 {f32:.1f} GFLOP/s",
                      round(bf16, 1), round(f32, 1))


def linear_in_row_blocks(x: torch.Tensor, out_features: int, block_rows: int,
                         product: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """x @ W.T of x's dtype, W taken in blocks of at most block_rows output rows: product(start, end) gives
    x @ W[start:end].T in whatever dtype it computes in (so only one block of a converted weight exists at
    a time). One block: its product is the output, converted once, with no copy into a preallocated one.
    Any device (the int8 and int4 layers use it on GPUs too)."""
    if out_features <= block_rows:
        return product(0, out_features).to(x.dtype)
    out = torch.empty(*x.shape[:-1], out_features, dtype=x.dtype, device=x.device)
    for start in range(0, out_features, block_rows):
        end = min(start + block_rows, out_features)
        out[..., start:end] = product(start, end)
    return out


def upcast_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for 16-bit x and weight, computed in float32: the weight converted
    in row blocks of at most UPCAST_BLOCK_BYTES (an LM head never has a float32 copy in memory), the
    output rounded to x's dtype once."""
    out_features, in_features = weight.shape
    x32 = x.float()

    def product(start: int, end: int) -> torch.Tensor:
        return F.linear(x32, weight[start:end].float(), None if bias is None else bias[start:end].float())

    return linear_in_row_blocks(x, out_features, max(1, UPCAST_BLOCK_BYTES // (4 * max(in_features, 1))), product)
