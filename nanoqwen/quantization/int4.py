"""Weight-only int4: `LLM(..., quantization="int4")`, `--quantization int4`.

int4 (`Int4Linear`, `Int4Experts`): the same matrices as int8 (int8.py's docstring; as with int8,
the router and the embedding stay as they are), asymmetric, one scale and one offset per group of G
consecutive inputs of a row (G = INT4_GROUP_SIZE = 64, or the largest of 32 and 16 that divides
in_features): for group g of row o, with lo, hi its smallest and largest weight,

    scale[o, g] = (hi - lo) / 15          in float32, stored in the model dtype rounded up (a
                                          constant group gets scale 1)
    offset[o, g] = lo                     stored in the model dtype (round to nearest)
    q[o, i] = round((W[o, i] - offset) / scale), clamped to 0..15
    W4[o, i] = offset + scale * q         |W - W4| <= scale / 2, plus offset's own rounding (half a
                                          model-dtype ulp of lo)
    y = x @ W4.T + bias                   W4 exact in float32; products accumulate in float32, the
                                          output rounds to the activation dtype once

Two nibbles per byte: `weight` is uint8 [out, in/2]; in group g (G/2 bytes) byte j holds element j
in its low and element j + G/2 in its high nibble, so a kernel turns 8 bytes into 16 weights with an
AND and a shift (nanoqwen/ops/cpu/csrc/int4_gemv.cpp). The rows are stored in blocks of INT4_BLOCK_ROWS =
16 (the last block holds what is left), each block lane by lane: for each group and each 4 bytes of
it, the block's rows' 4 bytes one row after the other, and likewise each group's 16 scales and
offsets. A vector then holds the same 8 elements of 8 rows, one row a lane, so the kernel's dot
products add up each row in its own lane (no sums across lanes, the scales a vector load).
Rows [16 i, 16 j) (or to the end) are whole blocks: they slice and dequantise on their own.
Bytes read per weight: 0.5 + 4 / G (4.5 bits at G = 64, as llama.cpp's q4_0). The group size was
chosen for quality and speed
(bench/bench_gemv.py measures the speed). Kernels: for bf16 rows on a CPU with AVX2 (up to 8, decode), nanoqwen's own
`int4_gemv` (whatever the matmul path: torch's int4 CPU kernel reads far below the bandwidth),
which quantises the activations to int8 in blocks of G (one float32 scale each, as llama.cpp's
q8_0 does in blocks of 32 for its q4_0 products) so that each group's dot product is an integer
one: decode rows compute x' @ W4.T with x' = x rounded to that grid (ops/cpu/kernels.py
int4_gemv_reference; its added error is small beside the weights', tests/quantization/test_int4.py; blocks of
64 add about as much error as blocks of 32 and make a faster kernel, docs/tried-and-not-kept.md);
more bf16 rows (prefill) take the same kernel's small GEMM (`int4_gemm`: the same function, the
weights unpacked 16 rows at a time into a buffer for the integer dot products), so a prompt and a
decode step compute alike: a request gets the same tokens whatever else shares its steps, however its
prompt is chunked and whether its prefix came from the cache (up to the order of float32 additions).
Otherwise (other dtypes, other devices, no compiler) the weights are
unpacked block by block to float32 (`dequantize_int4`, plain torch) and multiplied there on a CPU
whose bf16 matmuls are slow; where they are fast (native bf16) and on a GPU, W4 is rounded to the
activation dtype and multiplied in it (as the bf16 model's own matmuls are).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoqwen.layers.experts import Experts
from nanoqwen.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from nanoqwen.ops.cpu import kernels as cpu_kernels
from nanoqwen.ops.cpu.matmul import MatmulPath, linear_in_row_blocks
from nanoqwen.ops.quantize import INT4_BLOCK_ROWS, dequantize_int4, quantize_int4
from nanoqwen.quantization.base import QuantizedLinear, block_rows


class Int4Linear(QuantizedLinear):
    """y = x @ W4.T + bias with W4 = offset + scale * q per group: `weight` packed uint8
    [out, in/2], `scale` and `offset` [out, in/G] (model dtype; float16 or float32 for a GGUF file's, whose exact
    scales bf16 cannot hold: quantization/prequantized.py; no offset for a symmetric matrix, a GGUF file's Q4_0,
    whose offset is -8 scale), rows stored lane by lane in blocks of INT4_BLOCK_ROWS; see the module docstring."""

    BUFFERS = ("weight", "scale", "offset", "super_scale", "super_offset")

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                 super_scale: torch.Tensor | None = None, super_offset: torch.Tensor | None = None,
                 bias: nn.Parameter | None = None) -> None:
        """Two levels (a GGUF file's Q4_K): uint8 scale and offset (6-bit) with float32 super_scale and super_offset
        [out, in/(8G)], a group's scale super_scale * scale (ops/quantize.py two_level_scales); else None."""
        nn.Module.__init__(self)  # not Linear.__init__: no model-dtype weight to allocate
        for name, tensor in zip(self.BUFFERS, (weight, scale, offset, super_scale, super_offset), strict=True):
            self.register_buffer(name, tensor)  # (None: not a buffer, not in the state dict)
        self.bias = bias

    @staticmethod
    def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return quantize_int4(weight)

    @property
    def in_features(self) -> int:
        return 2 * self.weight.shape[1]

    def supers(self) -> tuple[torch.Tensor, ...]:
        """(super_scale, super_offset) for two-level scales, else ()."""
        return () if self.super_scale is None else (self.super_scale, self.super_offset)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = int4_linear(x, self.weight, self.scale, self.offset, self.matmul_path, *self.supers())
        return y if bias is None else y + bias


class Int4ColumnParallelLinear(Int4Linear, ColumnParallelLinear):
    """Int4Linear's matmul in a ColumnParallelLinear."""


class Int4RowParallelLinear(Int4Linear, RowParallelLinear):
    """Int4Linear's matmul in a RowParallelLinear (whose forward adds the ranks' parts)."""


INT4_VERSIONS: dict[type[Linear], type[QuantizedLinear]] = {
    Linear: Int4Linear, ColumnParallelLinear: Int4ColumnParallelLinear,
    RowParallelLinear: Int4RowParallelLinear}
Int4Linear.VERSIONS = INT4_VERSIONS


class Int4Experts(Experts):
    """Qwen3-MoE experts in int4: for each of gate_up_proj and down_proj, the packed matrices
    [E, out, in/2] and `{name}_scale`, `{name}_offset` [E, out, in/G]; expert e's matrix is
    quantised and multiplied as an Int4Linear of it would be."""

    def __init__(self, experts: Experts) -> None:
        nn.Module.__init__(self)  # not Experts.__init__: no model-dtype parameters to allocate
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(experts, name)  # [E, out, in]
            # each expert quantised on its own, so that no block of 16 rows spans two experts
            packed, scale, offset = zip(*(quantize_int4(expert) for expert in w), strict=True)
            self.register_buffer(name, torch.stack(packed))
            self.register_buffer(f"{name}_scale", torch.stack(scale))
            self.register_buffer(f"{name}_offset", torch.stack(offset))
        self.matmul_path = experts.matmul_path

    def expert_linear(self, x: torch.Tensor, name: str, e: int) -> torch.Tensor:
        return int4_linear(x, getattr(self, name)[e], getattr(self, f"{name}_scale")[e],
                           getattr(self, f"{name}_offset")[e], self.matmul_path)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                path: MatmulPath, *supers: torch.Tensor) -> torch.Tensor:
    """x @ W4.T: nanoqwen's int4 kernel for bf16 rows on CPU (any number of them: one function for every
    step), else W4 unpacked block by block (module docstring). The kernel is used whatever the CPU's matmul
    path: torch has no int4 kernel that reads near the bandwidth; from the path's int4_amx_min_rows rows on it
    computes on AMX tiles (int4_amx, the same bits as its panels)."""
    if x.device.type == "cpu" and x.dtype == torch.bfloat16 and cpu_kernels.available():
        if path.int4_amx_min_rows:
            return cpu_kernels.int4_gemv(x, packed, scale, offset, *supers, amx_min_rows=path.int4_amx_min_rows)
        return cpu_kernels.int4_gemv(x, packed, scale, offset, *supers)
    return int4_dequantized_linear(x, packed, scale, offset, torch.float32 if path.upcast_16bit(x) else None,
                                   *supers)


def int4_dequantized_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                            compute: torch.dtype | None = None, *supers: torch.Tensor) -> torch.Tensor:
    """x @ W4.T with W4 unpacked in row blocks (block_rows), multiplied in the compute dtype: the one the
    matmuls of this CPU run fastest in, as int8.py's dequantized_linear does: float32 where bf16 matmuls are
    slow (the product rounds once), else the activation dtype (the default; W4 rounded to it)."""
    out_features, in_features = packed.shape[0], 2 * packed.shape[1]
    compute = compute or x.dtype
    xc = x.to(compute)

    def product(start: int, end: int) -> torch.Tensor:  # x @ W4[start:end].T, W4 unpacked to the compute dtype
        rows = slice(start, end)
        return F.linear(xc, dequantize_int4(packed[rows], scale[rows], None if offset is None else offset[rows],
                                            *(t[rows] for t in supers)).to(compute))

    rows_per_block = max(1, block_rows(xc, in_features) // INT4_BLOCK_ROWS) * INT4_BLOCK_ROWS  # whole blocks
    return linear_in_row_blocks(x, out_features, rows_per_block, product)
