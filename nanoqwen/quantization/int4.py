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
AND and a shift (nanoqwen/ops/csrc/int4_gemv.cpp). The rows are stored in blocks of INT4_BLOCK_ROWS =
16 (the last block holds what is left), each block lane by lane: for each group and each 4 bytes of
it, the block's rows' 4 bytes one row after the other, and likewise each group's 16 scales and
offsets. A vector then holds the same 8 elements of 8 rows, one row a lane, so the kernel's dot
products add up each row in its own lane (no sums across lanes, the scales a vector load).
Rows [16 i, 16 j) (or to the end) are whole blocks: they slice and dequantise on their own.
Bytes read per weight: 0.5 + 4 / G (4.5 bits at G = 64, as llama.cpp's q4_0). The group size was
chosen by measured quality and speed
(BENCHMARKS.md). Kernels: for bf16 rows on a CPU with AVX2 (up to 8, decode), nanoqwen's own
`int4_gemv` (whatever the matmul path: torch's int4 CPU kernel reads far below the bandwidth),
which quantises the activations to int8 in blocks of G (one float32 scale each, as llama.cpp's
q8_0 does in blocks of 32 for its q4_0 products) so that each group's dot product is an integer
one: decode rows compute x' @ W4.T with x' = x rounded to that grid (ops/cpu_gemv.py
int4_gemv_reference; its added error is small beside the weights', tests/test_int4.py; blocks of
32 measured 1.7e-4 of KL against unquantised activations, blocks of 64 2.0e-4 and a faster
kernel, BENCHMARKS.md);
more bf16 rows (prefill) take the same kernel's small GEMM (`int4_gemm`: the same function, the
weights unpacked 16 rows at a time into a buffer for the integer dot products), so a prompt and a
decode step compute alike. On a CPU whose bf16 matmuls are faster still (AMX: several times
int4_gemm's integer rate), prompts of as many rows as ops/cpu.py measured it faster from instead
have the kernel unpack W4 to bf16 (`int4_unpack`, W4 rounded to bf16) for torch's bf16 matmul: x
is not quantised there, so a prompt's products differ from a decode step's by x's rounding to int8
and W4's to bf16. Otherwise (other dtypes, other devices, no compiler) the weights are
unpacked block by block to float32 (`dequantize_int4`, plain torch) and multiplied there on a CPU
whose bf16 matmuls are slow; where they are fast (native bf16) and on a GPU, W4 is rounded to the
activation dtype and multiplied in it (as the bf16 model's own matmuls are).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from nanoqwen.errors import ConfigError
from nanoqwen.models.qwen3 import ColumnParallelLinear, Experts, Linear, RowParallelLinear
from nanoqwen.ops import cpu
from nanoqwen.quantization.base import QUANTIZE_BLOCK_ELEMENTS, QuantizedLinear, block_rows, scale_rounded_up

INT4_GROUP_SIZE = 64  # inputs per int4 scale and offset (module docstring)
INT4_BLOCK_ROWS = 16  # int4 rows stored lane by lane, a block at a time (module docstring)


def int4_group_size(in_features: int, name: str = "a matrix") -> int:
    """INT4_GROUP_SIZE, or the largest of 32 and 16 that divides in_features; a ConfigError if none
    does."""
    group = math.gcd(in_features, INT4_GROUP_SIZE)
    if group < 16 or group % 16:
        raise ConfigError(f"quantization='int4' needs in_features divisible by 16; {name} has "
                          f"{in_features}: use quantization='int8' for this model")
    return group


@torch.no_grad()
def quantize_int4(weight: torch.Tensor, group_size: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [out, in] -> (packed uint8 [out, in/2], scale [out, in/G], offset [out, in/G] in W's
    dtype), rows in blocks of INT4_BLOCK_ROWS stored lane by lane; see the module docstring."""
    out_features, in_features = weight.shape
    g = group_size or int4_group_size(in_features)
    groups, dtype, device = in_features // g, weight.dtype, weight.device
    packed = torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device)
    scale = torch.empty(out_features, groups, dtype=dtype, device=device)
    offset = torch.empty(out_features, groups, dtype=dtype, device=device)
    step = max(1, QUANTIZE_BLOCK_ELEMENTS // max(in_features, 1))
    step = -(-step // INT4_BLOCK_ROWS) * INT4_BLOCK_ROWS  # row blocks that fit a cache, whole blocks of lanes
    for start in range(0, out_features, step):
        rows = slice(start, start + step)
        w = weight[rows].float().view(-1, groups, g)  # [r, groups, G]
        lo, hi = w.amin(-1), w.amax(-1)
        s32 = torch.where(hi > lo, (hi - lo) / 15, 1.0)
        s = scale_rounded_up(s32, dtype)  # 15 steps span hi
        o = lo.to(dtype)
        q = ((w - o.float()[..., None]) / s.float()[..., None]).round_().clamp_(0, 15).to(torch.uint8)
        low, high = q.view(-1, groups, 2, g // 2).unbind(2)  # elements j and j + G/2 of each group
        packed[rows] = int4_rows_to_lanes((low | (high << 4)).view(-1, in_features // 2), 4)
        scale[rows], offset[rows] = int4_rows_to_lanes(s, 1), int4_rows_to_lanes(o, 1)
    return packed, scale, offset


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
                    ) -> torch.Tensor:
    """offset + scale * q in float32 [out, in]: the weight an Int4Linear computes with (plain
    torch: the reference for the kernels). Any whole blocks of rows (rows [16 i, 16 j), or to the
    end) dequantise on their own."""
    packed, scale, offset = int4_lanes_to_rows(packed, 4), int4_lanes_to_rows(scale, 1), int4_lanes_to_rows(offset, 1)
    out_features, groups = scale.shape
    q = torch.stack([packed & 15, packed >> 4], dim=1)  # [out, 2, in/2]: low nibbles, high nibbles
    q = q.view(out_features, 2, groups, -1).transpose(1, 2)  # [out, groups, 2, G/2]
    w = offset.float()[..., None] + scale.float()[..., None] * q.reshape(out_features, groups, -1)
    return w.view(out_features, -1)


def int4_rows_to_lanes(t: torch.Tensor, width: int) -> torch.Tensor:
    """Rows [n, c * width] (c pieces of `width` values each) stored lane by lane in blocks of
    INT4_BLOCK_ROWS rows (the last block holds what is left): a block of L rows as [c, L, width]."""
    n, c = t.shape[0], t.shape[1] // width
    full = n - n % INT4_BLOCK_ROWS
    lanes = t[:full].view(full // INT4_BLOCK_ROWS, INT4_BLOCK_ROWS, c, width).transpose(1, 2)
    tail = t[full:].view(n - full, c, width).transpose(0, 1)
    return torch.cat([lanes.reshape(full, c * width), tail.reshape(n - full, c * width)])


def int4_lanes_to_rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """Rows stored by int4_rows_to_lanes, back in row order."""
    n, c = t.shape[0], t.shape[1] // width
    full = n - n % INT4_BLOCK_ROWS
    rows = t[:full].view(full // INT4_BLOCK_ROWS, c, INT4_BLOCK_ROWS, width).transpose(1, 2)
    tail = t[full:].view(c, n - full, width).transpose(0, 1)
    return torch.cat([rows.reshape(full, c * width), tail.reshape(n - full, c * width)])


class Int4Linear(QuantizedLinear):
    """y = x @ W4.T + bias with W4 = offset + scale * q per group: `weight` packed uint8
    [out, in/2], `scale` and `offset` [out, in/G] (model dtype), rows stored lane by lane in blocks
    of INT4_BLOCK_ROWS; see the module docstring."""

    BUFFERS = ("weight", "scale", "offset")

    @staticmethod
    def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return quantize_int4(weight)

    @property
    def in_features(self) -> int:
        return 2 * self.weight.shape[1]

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = int4_linear(x, self.weight, self.scale, self.offset)
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

    def expert_linear(self, x: torch.Tensor, name: str, e: int) -> torch.Tensor:
        return int4_linear(x, getattr(self, name)[e], getattr(self, f"{name}_scale")[e],
                           getattr(self, f"{name}_offset")[e])


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                offset: torch.Tensor) -> torch.Tensor:
    """x @ W4.T: nanoqwen's int4 kernel for bf16 rows on CPU (any number, except prompts where W4 unpacked to
    bf16 for torch's matmul was measured faster: ops/cpu.py int4_unpacked), else W4 unpacked block by block
    (module docstring)."""
    if (x.device.type == "cpu" and x.dtype == scale.dtype == torch.bfloat16
            and int4_kernels() is not None and not cpu.int4_unpacked(x)):
        return int4_kernels().int4_gemv(x, packed, scale, offset)
    return int4_dequantized_linear(x, packed, scale, offset)


def int4_dequantized_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                            offset: torch.Tensor) -> torch.Tensor:
    """x @ W4.T with W4 unpacked in row blocks (block_rows), multiplied in the
    dtype the matmuls of this CPU run fastest in, as int8.py's dequantized_linear does: float32 where bf16
    matmuls are slow (the product rounds once), else the activation dtype (W4 rounded to it)."""
    out_features, in_features = packed.shape[0], 2 * packed.shape[1]
    compute = torch.float32 if cpu.upcast_16bit(x) else x.dtype
    xc = x.to(compute)
    # bf16 on a CPU: nanoqwen's kernel unpacks, in one pass (the same bits as dequantize_int4 rounded to bf16)
    kernel = (compute == scale.dtype == torch.bfloat16 and x.device.type == "cpu" and int4_kernels() is not None)

    def product(start: int, end: int) -> torch.Tensor:  # x @ W4[start:end].T, W4 unpacked to the compute dtype
        rows = slice(start, end)
        if kernel:
            return F.linear(xc, int4_kernels().int4_unpack(packed[rows], scale[rows], offset[rows]))
        return F.linear(xc, dequantize_int4(packed[rows], scale[rows], offset[rows]).to(compute))

    rows_per_block = max(1, block_rows(xc, in_features) // INT4_BLOCK_ROWS) * INT4_BLOCK_ROWS  # whole blocks
    return cpu.linear_in_row_blocks(x, out_features, rows_per_block, product)


_int4_state: list = []  # [cpu_gemv module or None], once looked up


def int4_kernels():
    """nanoqwen/ops/cpu_gemv.py where its kernels are available (built on first use), else None.
    Used whatever the CPU's matmul path: torch has no int4 kernel that reads near the bandwidth."""
    if not _int4_state:
        from nanoqwen.ops import cpu_gemv

        _int4_state.append(cpu_gemv if cpu_gemv.available() else None)
    return _int4_state[0]
