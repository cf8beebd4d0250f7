"""How a model's matmuls run on a CPU: `MatmulPath`, the choice an engine makes once per CPU
(nanoqwen/ops/cpu/selection.py measures it) and hands to every layer that multiplies.

CPUs with native bf16 matrix instructions (AVX-512-BF16, AMX) multiply bf16 matrices as fast as
float32 ones or faster. On the others (AVX2-only: AMD Zen 2/3, most Intel client chips) torch's bf16
matrix-matrix product is many times slower than its float32 one, because every element is converted
in the inner loop. There, the weights stay 16-bit in memory (half the bytes; a matrix-vector
product, one decode row, reads them directly and stays fast) and products over many rows (prompt
chunks, large batches) convert the weights to float32 block by block and multiply in float32:
`upcast_linear` (the "float32" path). Prompt attention does the same (nanoqwen/attention/).

Either path computes the same function: bf16 inputs, products accumulated in float32, the output
rounded to bf16 once. Only the order of the float32 additions differs, so greedy tokens agree within
bf16's tolerance.

Beside the path, the choice says which rows nanoqwen's own kernels take (nanoqwen/ops/cpu/kernels.py): up to
`gemv_max_rows` rows its gemv kernels (decode steps), on CPUs with AMX tiles bf16 products of `bf16_amx_min_rows`
to AMX_MAX_ROWS rows on them (batched decode steps: torch's product reads the weights more slowly there) and int8
ones of `int8_amx_min_rows` to AMX_MAX_ROWS rows (int8_gemv is bound by its arithmetic there), and on
the float32 path more rows its GEMM where it was measured faster (`gemm`). `TORCH_MATMUL`, the default, is torch's
own kernels for everything: the reference, and what GPUs use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanoqwen.ops.cpu import kernels as cpu_kernels

PATHS = ("bf16", "float32")
# fewer rows read the 16-bit weights directly (a matrix-vector product is memory-bound)
UPCAST_MIN_ROWS = 16
# up to this many rows, nanoqwen's own kernels (ops/cpu/kernels.py) where they are on and measured faster
GEMV_MAX_ROWS = 64
# bf16 products of up to this many rows (batched decode steps, short prompt chunks) on AMX tiles where chosen
AMX_MAX_ROWS = 64
# int8 rows go through nanoqwen's int8 kernel up to this many, or up to the bf16 kernel's count if more
INT8_GEMV_MIN_ROWS = 16
# The largest float32 copy of a weight block that a product over many rows makes at a time on a CPU (upcast_linear,
# and the int8/int4 layers' unpacking): small enough that the copy is still in the L3 cache when the matmul reads
# it, so that the weights come from memory once, as 16-bit (or 8- or 4-bit) values.
UPCAST_BLOCK_BYTES = 4 << 20


def amx_shape(weight: torch.Tensor) -> bool:
    """Whether cpu_kernels.bf16_amx takes this weight: [N, K] with K a multiple of 32 and N of 16."""
    return weight.dim() == 2 and weight.shape[1] % 32 == 0 and weight.shape[0] % 16 == 0


@dataclass(frozen=True)
class MatmulPath:
    """How 16-bit matmuls run on this CPU, and which rows nanoqwen's own kernels take.

    path: "bf16" (torch's own kernel) or "float32" (16-bit operands computed in float32 over many rows).
    The methods say, for one product's activations x, which kernel computes it; every layer that multiplies
    asks them (nanoqwen/layers/linear.py, nanoqwen/quantization/, nanoqwen/attention/).
    """

    path: str = "bf16"
    reason: str = "torch's kernels"  # why, for the log line and `nanoqwen bench`
    bf16_gflops: float | None = None
    float32_gflops: float | None = None
    gemv_max_rows: int = 0  # few rows (decode), up to this many, through nanoqwen's gemv kernels
    gemv_reason: str = ""  # why
    gemm: bool = False  # on the float32 path, more rows through nanoqwen's bf16_gemm, not upcast_linear
    gemm_reason: str = ""  # why
    # int4 products of at least this many rows on AMX tiles (cpu_kernels.int4_amx; 0: never), and why
    int4_amx_min_rows: int = 0
    int4_amx_reason: str = ""
    # bf16 products of bf16_amx_min_rows .. AMX_MAX_ROWS rows on AMX tiles (cpu_kernels.bf16_amx; 0: never), and why
    bf16_amx_min_rows: int = 0
    bf16_amx_reason: str = ""
    # int8 products of int8_amx_min_rows .. AMX_MAX_ROWS rows on AMX tiles (cpu_kernels.int8_amx; 0: never), and why
    int8_amx_min_rows: int = 0
    int8_amx_reason: str = ""

    @property
    def gemv(self) -> bool:
        """Whether nanoqwen's gemv kernels take any rows."""
        return self.gemv_max_rows > 0

    def describe(self) -> str:
        few = f"<= {self.gemv_max_rows} rows: nanoqwen's gemv kernels ({self.gemv_reason}); " if self.gemv else ""
        if self.int4_amx_min_rows:
            few += f"int4 products of >= {self.int4_amx_min_rows} rows on AMX tiles ({self.int4_amx_reason}); "
        if self.bf16_amx_min_rows:  # (rows the gemv kernels take go to them first)
            fewest = max(self.bf16_amx_min_rows, self.gemv_max_rows + 1)
            few += f"bf16 products of {fewest}-{AMX_MAX_ROWS} rows on AMX tiles ({self.bf16_amx_reason}); "
        if self.int8_amx_min_rows:
            few += (f"int8 products of {self.int8_amx_min_rows}-{AMX_MAX_ROWS} rows on AMX tiles "
                    f"({self.int8_amx_reason}); ")
        if self.path == "bf16":
            return f"{few}bf16 matmuls ({self.reason})"
        more = max(UPCAST_MIN_ROWS, self.gemv_max_rows + 1)  # (the rows the gemv kernels leave)
        how = f"nanoqwen's bf16_gemm, {self.gemm_reason}; " if self.gemm else ""
        return f"{few}>= {more} rows: float32 compute from 16-bit weights ({how}{self.reason})"

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear for x [N, in] on this path: a few bf16 rows through the gemv kernel (when on), many
        16-bit rows computed in float32 (on the float32 path: nanoqwen's bf16_gemm where chosen, else
        upcast_linear), everything else torch's own F.linear (tensors off the CPU included)."""
        if self.path == "bf16" and not self.gemv and not self.bf16_amx_min_rows:
            return F.linear(x, weight, bias)
        rows = x.shape[0]
        bf16 = x.dtype == weight.dtype == torch.bfloat16 and x.device.type == "cpu"
        if bf16 and rows <= self.gemv_max_rows:
            return cpu_kernels.bf16_gemv(x, weight, bias)
        if bf16 and self.amx_rows(rows) and x.dim() == 2 and amx_shape(weight):
            y = cpu_kernels.bf16_amx(x, weight)
            return y if bias is None else y + bias
        if rows >= UPCAST_MIN_ROWS and self.upcast_16bit(x):
            if self.own_gemm(x) and bf16 and bias is None:
                return cpu_kernels.bf16_gemm(x, weight)
            return upcast_linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def int8_gemv_rows(self, x: torch.Tensor) -> bool:
        """Whether an int8 product over x's rows goes through nanoqwen's int8 kernel: the gemv kernels on,
        bf16 x, up to INT8_GEMV_MIN_ROWS rows whatever the bf16 limit, because its alternative for few rows,
        torch's int8pack, was slower at every row count up to 16 (bench/bench_gemv.py); up to the bf16
        kernel's row count where that is higher. On the bf16 path, up to GEMV_MAX_ROWS: there the alternative
        above 16 rows dequantises every int8 matrix to bf16 on every step, which costs several times what the
        int8 kernel's own reads of 64 rows cost (bench/bench_batch_decode.py, int8 batches of 32 and 64); on
        the float32 path rows above the gemv limit go to the int8 GEMM or the float32 product instead."""
        most = max(INT8_GEMV_MIN_ROWS, self.gemv_max_rows, GEMV_MAX_ROWS if self.path == "bf16" else 0)
        return (self.gemv and x.dtype == torch.bfloat16 and x.device.type == "cpu"
                and x.numel() <= most * x.shape[-1])

    def own_gemm(self, x: torch.Tensor) -> bool:
        """Whether work over bf16 x's many rows goes through nanoqwen's GEMM kernel: the bf16 products
        (bf16_gemm) and a prompt chunk's attention (cpu_kernels.prefill_attention, its two products). Where the
        GEMM was chosen, on the float32 path."""
        return self.gemm and x.dtype == torch.bfloat16 and self.upcast_16bit(x)

    def amx_rows(self, rows: int) -> bool:
        """Whether a bf16 product of this many rows runs on AMX tiles (cpu_kernels.bf16_amx)."""
        return 0 < self.bf16_amx_min_rows <= rows <= AMX_MAX_ROWS

    def int8_amx_rows(self, x: torch.Tensor, in_features: int, out_features: int) -> bool:
        """Whether an int8 product of bf16 x's rows and a [out_features, in_features] matrix runs on AMX tiles
        (cpu_kernels.int8_amx): from int8_amx_min_rows to AMX_MAX_ROWS rows, a shape the tiles take (amx_shape)."""
        rows = x.numel() // max(in_features, 1)
        return (0 < self.int8_amx_min_rows <= rows <= AMX_MAX_ROWS and x.dtype == torch.bfloat16
                and x.device.type == "cpu" and in_features % 32 == 0 and out_features % 16 == 0
                and out_features > 0)

    def own_prompt_softmax(self, x: torch.Tensor) -> bool:
        """Whether a bf16 prompt chunk's attention (queries x) runs torch's two products around nanoqwen's
        softmax kernel (attention/backends/cpu_prefill.py): on the bf16 path, where nanoqwen's kernels are on."""
        return self.gemv and self.path == "bf16" and x.dtype == torch.bfloat16 and x.device.type == "cpu"

    def upcast_16bit(self, x: torch.Tensor) -> bool:
        """Whether a product over x's rows computes in float32 from 16-bit operands (CPU without fast
        bf16)."""
        return (self.path == "float32" and x.device.type == "cpu"
                and x.dtype in (torch.bfloat16, torch.float16))


TORCH_MATMUL = MatmulPath()


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
