"""Weight-only int8 with a scale (and an offset) per group of inputs: the format that holds a GGUF file's Q8_0,
Q5_0, Q5_1, Q5_K and Q6_K matrices exactly (nanoqwen/quantization/prequantized.py; the unpacking:
nanoqwen/ops/gguf_quants.py).

For W [out, in] in groups of G consecutive inputs of a row (G = 32, or 16 for Q6_K):

    W[o, i] = q[o, i] * scale[o, g] + offset[o, g]     g = i // G; q int8 (or fewer bits, below); offset
                                                       absent for the symmetric types (Q8_0, Q6_K)
    y = x @ W.T + bias                                 products accumulate in float32, the output rounds to
                                                       the activation dtype once

Scales and offsets are the file's own values, exact: float16 where the file's are float16 (Q8_0's, Q5_0's and
Q5_1's d and m; Q5_0's values are held as q + 16 without offsets, the symmetric 5-bit form whose offset -16 d the
kernels make from d), or in two levels as the K types
hold them: small integers a group (`scale`, `offset`: Q5_K's 6-bit sub-scales and mins as uint8, Q6_K's int8
sub-scales) times a float32 per super-block of groups (`super_scale`, `super_offset`: Q5_K's d and -dmin per 8
groups, Q6_K's d per 16). The values are packed where they fit fewer bits (ops/quantize.py): Q5's 0..31 at 5 bits
(`weight` uint8 [out, 5 in / 8], pack_int5), Q6_K's -32..31 at 6 (uint8 [out, 3 in / 4], pack_int6). Bits a
weight: Q8_0 8.5, Q5_0 5.5, Q5_1 6, Q5_K 5.75, Q6_K 6.625 (the file's: 8.5, 5.5, 6, 5.5, 6.5625).

Kernels: for up to 16 bf16 rows on a CPU with nanoqwen's kernels (decode), `int8_group_gemv`
(ops/cpu/kernels.py): x rounded to int16 per group (as int8_gemv rounds it per 64), integer dot products per
group, each scaled in float32 (int8_group_gemv_reference there is its definition). Otherwise (prompts, other
dtypes and devices) the matrix is dequantised row block by row block to the compute dtype and multiplied
there (`int8_group_dequantized_linear`; ops/quantize.py's dequantize_int8_group is the reference for the weights,
which on a CPU with nanoqwen's kernels `int8_group_dequantize` computes bit for bit in one pass).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoqwen.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from nanoqwen.ops.cpu import kernels as cpu_kernels
from nanoqwen.ops.cpu.matmul import MatmulPath, linear_in_row_blocks
from nanoqwen.ops.quantize import dequantize_int8_group, packed_bits
from nanoqwen.quantization.base import QuantizedLinear, block_rows

GEMV_MAX_ROWS = 16  # rows of x the kernel takes; more dequantise (a prompt: the dequantised product is faster)


class Int8GroupLinear(QuantizedLinear):
    """y = x @ W.T + bias with W = q * scale + offset per group: `weight` int8 [out, in] (or uint8: packed at 5 or 6
    bits), `scale` and `offset` [out, in/G] float32 or float16 (`offset` None for a symmetric type), or in two levels
    with `super_scale` and `super_offset` float32 [out, in/(SG)]; see the module docstring."""

    BUFFERS = ("weight", "scale", "offset", "super_scale", "super_offset")

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                 super_scale: torch.Tensor | None = None, super_offset: torch.Tensor | None = None,
                 bias: nn.Parameter | None = None) -> None:
        nn.Module.__init__(self)
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)
        self.register_buffer("offset", offset)  # (None: not a buffer, not in the state dict)
        self.register_buffer("super_scale", super_scale)
        self.register_buffer("super_offset", super_offset)
        self.bias = bias

    @property
    def in_features(self) -> int:
        return self.weight.shape[1] * 8 // packed_bits(self.weight, self.scale.shape[1])

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = int8_group_linear(x, self.weight, self.scale, self.offset, self.super_scale, self.super_offset,
                              self.matmul_path)
        return y if bias is None else y + bias


class Int8GroupColumnParallelLinear(Int8GroupLinear, ColumnParallelLinear):
    """Int8GroupLinear's matmul in a ColumnParallelLinear."""


class Int8GroupRowParallelLinear(Int8GroupLinear, RowParallelLinear):
    """Int8GroupLinear's matmul in a RowParallelLinear (whose forward adds the ranks' parts)."""


INT8_GROUP_VERSIONS: dict[type[Linear], type[QuantizedLinear]] = {
    Linear: Int8GroupLinear, ColumnParallelLinear: Int8GroupColumnParallelLinear,
    RowParallelLinear: Int8GroupRowParallelLinear}
Int8GroupLinear.VERSIONS = INT8_GROUP_VERSIONS


def int8_group_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                      super_scale: torch.Tensor | None, super_offset: torch.Tensor | None, path: MatmulPath
                      ) -> torch.Tensor:
    """x @ W.T: nanoqwen's kernel for few bf16 rows on CPU, else W dequantised block by block (module
    docstring)."""
    rows = x.numel() // max(x.shape[-1], 1)
    if (x.device.type == "cpu" and x.dtype == torch.bfloat16 and rows <= GEMV_MAX_ROWS
            and cpu_kernels.available()):
        return cpu_kernels.int8_group_gemv(x, q, scale, offset, super_scale, super_offset)
    return int8_group_dequantized_linear(x, q, scale, offset, super_scale, super_offset,
                                         torch.float32 if path.upcast_16bit(x) else None)


def int8_group_dequantized_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                                  super_scale: torch.Tensor | None = None, super_offset: torch.Tensor | None = None,
                                  compute: torch.dtype | None = None) -> torch.Tensor:
    """x @ W.T with W dequantised in row blocks (block_rows) to the compute dtype (x's by default; float32 where
    this CPU's bf16 matmuls are slow), as int4.py's int4_dequantized_linear does."""
    out_features, in_features = q.shape[0], q.shape[1] * 8 // packed_bits(q, scale.shape[1])
    xc = x.to(compute or x.dtype)

    def product(start: int, end: int) -> torch.Tensor:
        rows = slice(start, end)
        pick = lambda t: None if t is None else t[rows]  # noqa: E731
        parts = (q[rows], scale[rows], pick(offset), pick(super_scale), pick(super_offset))
        if q.device.type == "cpu" and cpu_kernels.available():  # the same matrix, in one pass
            w = cpu_kernels.int8_group_dequantize(*parts, in_features)
        else:
            w = dequantize_int8_group(*parts)
        return F.linear(xc, w.to(xc.dtype))

    return linear_in_row_blocks(x, out_features, block_rows(xc, in_features), product)
