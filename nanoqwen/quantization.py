"""Weight-only quantisation: `LLM(..., quantization="int8" | "int4")`, `--quantization int8|int4`.

Two formats, made at load from the checkpoint's bf16/fp16/fp32 weights; the int8 one is described
first, int4 (group-wise, 4.5 bits a weight) after it ("int4" below).

int8.

What is quantised: every `Linear` of the model, swapped for an `Int8Linear` as soon as the loader
has filled it (loader.load_model: on CPU loading never holds the whole model-dtype model, memory
peaks near the int8 one; on a GPU the parameters are allocated when the model is built, so the peak
there is the model-dtype model; the checkpoint stays bf16/fp32 on disk): qkv_proj, o_proj,
gate_up_proj and down_proj of every layer, and the LM head. A tied head gets its own int8 copy; the
embedding lookup keeps the model-dtype matrix (it reads one row per token, so it costs memory but no
decode time). Norms, embeddings and biases stay in the model dtype, and so do activations and the KV
cache. Qwen3-MoE's experts (stacked [E, out, in] tensors) become `Int8Experts`: every expert's
matrix quantised and computed exactly as an Int8Linear of it would be. Its router stays exact (a
`Linear` named `gate`: tiny, and kept so that int8 noise does not change which experts a token goes
to, as vLLM does).

Numerics (symmetric, one scale per output row, no zero point), for W [out, in]:

    scale[o] = max_i |W[o, i]| / 127      computed in float32, then stored in the model dtype,
                                          rounded up there so that |W / scale| <= 127 (a zero row
                                          gets scale 1): at most one step of that dtype above (2^-7
                                          relative in bf16; in fp16, rows with max|W| < 7.8e-3 get a
                                          subnormal, coarser scale)
    Wq[o, i] = round(W[o, i] / scale[o])  int8 in [-127, 127] (-128 is never used), round half to
                                          even
    |W - Wq * scale| <= scale / 2         per element: about max|W[o]| / 254
    y = (x @ Wq.T) * scale + bias         int8 values convert exactly to bf16/fp16/fp32 (|Wq| <= 127
                                          fits an 8-bit significand); products accumulate in float32
                                          inside the kernels; the output is rounded to the
                                          activation dtype once (int8pack kernel) or twice (matmul
                                          output, then the scaling: dequantise path; once where it
                                          computes in float32, see ops/cpu.py)

Kernels, chosen per call:
- CPU where nanoqwen's gemv kernels are on (ops/cpu.py: measured against torch's), up to 16 bf16
  rows (int8pack was slower at each row count), or up to the bf16 kernel's measured row count where
  that is higher: nanoqwen's own AVX2 kernel (ops/cpu_gemv.py `int8_gemv`), which streams the int8
  rows once for all the rows of x. It multiplies in integers: x rounded to int16 in blocks of 64
  (one float32 scale each: an error of at most 2^-16 of the block's largest value), int16 products summed
  in int32.
- CPU, few rows (decode), bf16/fp16 activations: `torch.ops.aten._weight_int8pack_mm`, which reads
  the int8 matrix directly: half the bytes of a bf16 matrix-vector product, so batch-1 decode runs
  faster. Its cost grows with every 4 rows while a bf16 matmul's barely grows, so above
  INT8PACK_MAX_ROWS rows (measured; see there) the matmul dequantises instead. The kernel needs a
  contiguous 2-D input, the scale in the input dtype and in_features % 16 == 0 (other widths crash
  the process in torch 2.13: they take the dequantise path). Its float32 path is much slower than
  its bf16 one, and slower than a float32 matmul: float32 models always dequantise (about the
  float32 model's speed, with a quarter of the weight bytes).
- CPU, more bf16 rows on the float32 path where nanoqwen's GEMM was chosen (ops/cpu.py): its int8
  version (ops/cpu_gemv.py `int8_gemm`), which converts the int8 weights to float32 while packing
  them, computes what the float32 dequantise path below computes (rounded once), and is faster.
- CPU, otherwise (prefill, float32): dequantise block by block,
  `F.linear(x, Wq[rows].to(x.dtype)) * scale[rows]`, with blocks of at most ops/cpu.py's
  UPCAST_BLOCK_BYTES so a big matrix (the LM head) never has a model-dtype copy in memory.
- CUDA and other devices: the same dequantise path (nothing compiles it into one kernel there). Run
  eagerly it converts each matrix on every call: memory is saved, speed is not gained (untested on a
  GPU).
The two CPU kernels round differently (and differently from the bf16 model), so with int8 a
sequence's greedy tokens can depend on the batch it runs in, where a near-tie is flipped: a prompt
of <= INT8PACK_MAX_ROWS tokens prefilled alone takes int8pack, prefilled beside others the
dequantise kernel. Decode rows take the same kernel at any batch size up to INT8PACK_MAX_ROWS.

int4 (`Int4Linear`, `Int4Experts`): the same matrices (and, as with int8, the router and the
embedding stay as they are), asymmetric, one scale and one offset per group of G consecutive inputs
of a row (G = INT4_GROUP_SIZE = 64, or the largest of 32 and 16 that divides in_features): for group
g of row o, with lo, hi its smallest and largest weight,

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

import ctypes
import math
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from nanoqwen.errors import ConfigError
from nanoqwen.models.qwen3 import ColumnParallelLinear, Experts, Linear, RowParallelLinear
from nanoqwen.ops import cpu

QUANTIZATION_METHODS = ("int8", "int4")
# int8pack's cost grows every 4 rows while a bf16 matmul's barely does, so above this many rows
# (tokens) the dequantise path is faster on CPU (measured, see BENCHMARKS.md).
INT8PACK_MAX_ROWS = 16
# the largest model-dtype copy of a weight block the dequantise path makes on a GPU (on a CPU, BF16_BLOCK_BYTES
# below, or for float32 compute ops/cpu.py's UPCAST_BLOCK_BYTES)
DEQUANT_BLOCK_BYTES = 16 << 20
QUANTIZE_BLOCK_ELEMENTS = 1 << 18  # rows quantised at a time: float32 temporaries of 1 MiB
KEEP_UNQUANTIZED = ("gate",)  # Linears left as they are, by attribute name: Qwen3-MoE's router
INT4_GROUP_SIZE = 64  # inputs per int4 scale and offset (module docstring)
INT4_BLOCK_ROWS = 16  # int4 rows stored lane by lane, a block at a time (module docstring)
# On a CPU whose bf16 matmuls are fast (native bf16, AMX), the int8 and int4 layers' bf16 copy of a block of weight
# rows for torch's matmul over many rows is at most this big: whole matrices of the smaller models. A matmul per
# 4 MiB block (UPCAST_BLOCK_BYTES, which the float32 path keeps small to stay in the cache) made a Qwen3-0.6B layer's
# four products at 512 rows 1.3x slower than one matmul each, in int8 and int4 alike (BENCHMARKS.md).
BF16_BLOCK_BYTES = 64 << 20


def check_quantization(method: str | None) -> str | None:
    """The method if it is supported (None: no quantisation), else a ConfigError naming the
    choices."""
    if method is None or method in QUANTIZATION_METHODS:
        return method
    raise ConfigError(f"quantization={method!r} is not supported; use one of: "
                      f"{', '.join(QUANTIZATION_METHODS)} "
                      "(or None for the checkpoint's own weights)")


@torch.no_grad()
def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] -> (int8 Wq [out, in], scale [out] in W's dtype); see the module docstring."""
    out_features, in_features = weight.shape
    dtype = weight.dtype
    q = torch.empty(out_features, in_features, dtype=torch.int8, device=weight.device)
    scale = torch.empty(out_features, dtype=dtype, device=weight.device)
    up = torch.tensor(float("inf"), dtype=dtype, device=weight.device)
    step = max(1, QUANTIZE_BLOCK_ELEMENTS // max(in_features, 1))
    # in row blocks that fit a cache: several times faster
    for start in range(0, out_features, step):
        w = weight[start: start + step]
        amax = w.abs().amax(dim=1).float()  # exact in any dtype: a max does not round
        s32 = torch.where(amax > 0, amax / 127, 1.0)
        s = s32.to(dtype)
        # round up: |w / s| <= 127, no clipping
        s = torch.where(s.float() < s32, torch.nextafter(s, up), s)
        # float32 division (out of place: a float32 weight's .float() is the weight itself).
        # Converting first is faster than dividing the bf16 block by a float32 column, which torch
        # does far slower.
        q[start: start + step] = torch.div(w.float(), s.float()[:, None]).round_().clamp_(-127, 127)
        scale[start: start + step] = s
    return q, scale


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Wq * scale in float32 [out, in]: the weight an Int8Linear computes with."""
    return q.float() * scale.float()[:, None]


class QuantizedLinear(Linear):
    """A Linear whose matrix is stored quantised, as buffers: `weight` (int8 [out, in], or int4
    packed two to a byte [out, in/2]) and its scales (`BUFFERS`), with the bias in the model dtype.

    Only `matmul` differs from Linear: a tensor-parallel linear's quantised version (e.g.
    Int8ColumnParallelLinear, Int8RowParallelLinear below) keeps its class's forward, all_reduce
    included.
    """

    BUFFERS: tuple[str, ...] = ("weight",)
    # the quantised version of each Linear class (set after the subclasses below)
    VERSIONS: dict[type[Linear], type[QuantizedLinear]] = {}

    def __init__(self, *buffers: torch.Tensor, bias: nn.Parameter | None = None) -> None:
        """The BUFFERS in order, then the bias [out] (or None); see from_linear."""
        nn.Module.__init__(self)  # not Linear.__init__: no model-dtype weight to allocate
        for name, tensor in zip(self.BUFFERS, buffers, strict=True):
            self.register_buffer(name, tensor)
        self.bias = bias

    @classmethod
    def from_linear(cls, linear: Linear) -> QuantizedLinear:
        """The quantised version of a Linear (scales and bias in the Linear's dtype); the Linear is
        left as it is."""
        version = cls.VERSIONS[type(linear)]
        quantized = version(*version.quantize(linear.weight), bias=linear.bias)
        for name in ("output_sizes", "tp_size"):  # a tensor-parallel linear's own attributes
            if hasattr(linear, name):
                setattr(quantized, name, getattr(linear, name))
        return quantized

    @staticmethod
    def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


class Int8Linear(QuantizedLinear):
    """y = (x @ weight.T) * scale + bias with an int8 `weight` [out, in] and a per-row `scale` [out]
    (model dtype). Named like `Linear` (weight [out, in]), so whatever slices a Linear's rows or
    columns can slice this one's the same way (scale goes with the rows)."""

    BUFFERS = ("weight", "scale")

    @staticmethod
    def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_weight(weight)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        kernel = pick_kernel(x, self.in_features)
        y = kernel(x, self.weight, self.scale.to(x.dtype))
        return y if bias is None else y + bias


class Int8ColumnParallelLinear(Int8Linear, ColumnParallelLinear):
    """Int8Linear's matmul in a ColumnParallelLinear."""


class Int8RowParallelLinear(Int8Linear, RowParallelLinear):
    """Int8Linear's matmul in a RowParallelLinear (whose forward adds the ranks' parts)."""


INT8_VERSIONS: dict[type[Linear], type[QuantizedLinear]] = {
    Linear: Int8Linear, ColumnParallelLinear: Int8ColumnParallelLinear,
    RowParallelLinear: Int8RowParallelLinear}
Int8Linear.VERSIONS = INT8_VERSIONS


class Int8Experts(Experts):
    """Qwen3-MoE experts with int8 matrices: buffers gate_up_proj [E, 2Ie, H] and down_proj
    [E, H, Ie] (int8), gate_up_proj_scale [E, 2Ie] and down_proj_scale [E, H] (one scale per row of
    each expert, model dtype). Expert e's matrix is quantised as Int8Linear quantises a matrix, and
    each expert's matmul picks its kernel the same way (int8pack for up to INT8PACK_MAX_ROWS tokens
    on CPU, else dequantise): Experts.forward's grouping is unchanged, only `expert_linear` reads
    int8.
    """

    def __init__(self, experts: Experts) -> None:
        nn.Module.__init__(self)  # not Experts.__init__: no model-dtype parameters to allocate
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(experts, name)  # [E, out, in]
            # the experts' rows, one after another
            q, scale = quantize_weight(w.reshape(-1, w.shape[-1]))
            self.register_buffer(name, q.view(w.shape))
            self.register_buffer(f"{name}_scale", scale.view(w.shape[:2]))

    def expert_linear(self, x: torch.Tensor, name: str, e: int) -> torch.Tensor:
        q, scale = getattr(self, name)[e], getattr(self, f"{name}_scale")[e]
        return pick_kernel(x, q.shape[1])(x, q, scale.to(x.dtype))


# ---- int4: group-wise, asymmetric (module docstring)


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
    up = torch.tensor(float("inf"), dtype=dtype, device=device)
    step = max(1, QUANTIZE_BLOCK_ELEMENTS // max(in_features, 1))
    step = -(-step // INT4_BLOCK_ROWS) * INT4_BLOCK_ROWS  # row blocks that fit a cache, whole blocks of lanes
    for start in range(0, out_features, step):
        rows = slice(start, start + step)
        w = weight[rows].float().view(-1, groups, g)  # [r, groups, G]
        lo, hi = w.amin(-1), w.amax(-1)
        s32 = torch.where(hi > lo, (hi - lo) / 15, 1.0)
        s = s32.to(dtype)
        s = torch.where(s.float() < s32, torch.nextafter(s, up), s)  # round up: 15 steps span hi
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
    """x @ W4.T with W4 unpacked in row blocks (_block_rows), multiplied in the
    dtype the matmuls of this CPU run fastest in, as dequantized_linear does: float32 where bf16
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

    block_rows = max(1, _block_rows(xc, in_features) // INT4_BLOCK_ROWS) * INT4_BLOCK_ROWS  # whole blocks
    return cpu.linear_in_row_blocks(x, out_features, block_rows, product)


_int4_state: list = []  # [cpu_gemv module or None], once looked up


def int4_kernels():
    """nanoqwen/ops/cpu_gemv.py where its kernels are available (built on first use), else None.
    Used whatever the CPU's matmul path: torch has no int4 kernel that reads near the bandwidth."""
    if not _int4_state:
        from nanoqwen.ops import cpu_gemv

        _int4_state.append(cpu_gemv if cpu_gemv.available() else None)
    return _int4_state[0]


def int8pack_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(x @ q.T) * scale through the CPU kernel that reads int8 weights directly (see
    int8pack_supported)."""
    in_features = q.shape[1]
    rows = x.numel() // in_features
    y = torch.ops.aten._weight_int8pack_mm(x.reshape(rows, in_features).contiguous(), q, scale)
    return y.view(*x.shape[:-1], q.shape[0])


def int8pack_supported(dtype: torch.dtype, in_features: int) -> bool:
    """Whether the CPU int8pack kernel takes (and is fast for) this input: bf16/fp16,
    in_features % 16 == 0."""
    return dtype in (torch.bfloat16, torch.float16) and in_features > 0 and in_features % 16 == 0


def dequantized_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(x @ q.T) * scale with q converted to x's dtype in row blocks (_block_rows)
    (to float32 on a CPU whose bf16 matmuls are slow, nanoqwen/ops/cpu.py: the product then rounds
    once, not twice)."""
    out_features, in_features = q.shape
    compute = torch.float32 if cpu.upcast_16bit(x) else x.dtype
    xc = x.to(compute)

    def product(start: int, end: int) -> torch.Tensor:
        return F.linear(xc, q[start:end].to(compute)) * scale[start:end].to(compute)

    return cpu.linear_in_row_blocks(x, out_features, _block_rows(xc, in_features), product)


def _block_rows(xc: torch.Tensor, in_features: int) -> int:
    """How many weight rows the dequantise paths convert at a time, for activations xc in the compute dtype."""
    if xc.device.type != "cpu":
        block_bytes = DEQUANT_BLOCK_BYTES
    else:  # float32 compute (a CPU without fast bf16, or a float32 model): cache-sized blocks
        block_bytes = cpu.UPCAST_BLOCK_BYTES if xc.dtype == torch.float32 else BF16_BLOCK_BYTES
    return max(1, block_bytes // (max(in_features, 1) * xc.element_size()))


def pick_kernel(x: torch.Tensor, in_features: int
                ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The kernel for this input: int8pack for few rows on CPU, dequantise otherwise (module
    docstring)."""
    if x.device.type != "cpu":
        return dequantized_linear
    if cpu.int8_gemv_rows(x):
        # where nanoqwen's gemv kernels are on: its own kernel (ops/cpu_gemv.py) reads the int8 rows
        return cpu.int8_gemv
    if cpu.own_gemm(x):  # more rows, where nanoqwen's GEMM was chosen: its int8 version
        return cpu.int8_gemm
    rows = x.numel() // in_features if in_features else 0
    if rows <= INT8PACK_MAX_ROWS and int8pack_supported(x.dtype, in_features):
        return int8pack_linear
    return dequantized_linear


def quantize_model(model: nn.Module, method: str | None = "int8") -> nn.Module:
    """Swap every Linear of the model for its quantised version (Int8Linear, Int4Linear) and every
    MoE layer's Experts for Int8Experts / Int4Experts, in place; returns the model. (Loading with
    quantization quantises each module as it is filled: loader.load_model.)

    One module at a time, each freed as soon as its quantised version replaces it and its memory handed
    back to the OS (release_freed_memory), so memory peaks near the model-dtype weights plus one
    matrix (one layer's stacked experts for MoE; a tied LM head's matrix stays: it is the
    embedding).
    """
    if check_quantization(method) is None:
        return model
    for name in [name for name, _ in model.named_modules() if name]:  # (named before any swap)
        quantize_module(model, name, method)
    return model


LINEARS: dict[str, type[QuantizedLinear]] = {"int8": Int8Linear, "int4": Int4Linear}
EXPERTS: dict[str, type[Experts]] = {"int8": Int8Experts, "int4": Int4Experts}


def quantize_module(model: nn.Module, name: str, method: str = "int8") -> None:
    """Swap module `name` for its quantised version if it is a Linear (other than the router) or
    Experts; else leave it. The model-dtype weights are freed here, unless something else still
    holds them (a tied embedding)."""
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    module = getattr(parent, attr)
    if type(module) in INT8_VERSIONS and attr not in KEEP_UNQUANTIZED:
        if method == "int4":  # (a clear error naming the matrix, before any work)
            int4_group_size(module.weight.shape[1], name)
        quantized = LINEARS[method].from_linear(module)
    elif type(module) is Experts:
        if method == "int4":
            for matrix in ("gate_up_proj", "down_proj"):
                int4_group_size(getattr(module, matrix).shape[-1], f"{name}.{matrix}")
        quantized = EXPERTS[method](module)
    else:
        return
    setattr(parent, attr, quantized)
    del module  # the model-dtype matrices' last reference
    if next(quantized.buffers()).device.type == "cpu":
        release_freed_memory()  # every time (~10 us): see there


def release_freed_memory() -> None:
    """Return the freed heap pages to the OS (glibc's malloc_trim; a no-op elsewhere).

    glibc keeps freed memory for reuse: the model-dtype matrices' pages would stay in the process's
    RSS, and a matrix allocated above glibc's mmap threshold (the LM head's, 0.16 GB for Qwen3-0.6B)
    would take new pages on top of them.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        pass


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights in memory (parameters and saved buffers; a tensor shared by two
    names once)."""
    tensors = {t.data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}
    return sum(tensors.values())
