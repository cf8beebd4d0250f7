"""Weight quantisation formats as plain tensor functions: quantise a matrix, and dequantise it back (the
references the kernels and the quantised layers are tested against). What each format is, and which kernels
compute with it: nanoqwen/quantization/int8.py and int4.py.

- int8: symmetric, one int8 value a weight and one scale per output row (`quantize_weight`,
  `dequantize_weight`).
- int4: asymmetric, two weights a byte with a scale and an offset per group of INT4_GROUP_SIZE inputs of a
  row, rows stored lane by lane in blocks of INT4_BLOCK_ROWS (`quantize_int4`, `dequantize_int4`; `pack_int4` for
  a GGUF file's, whose scales may come in two levels).
- grouped int8: int8 values with a scale (and offset) per group (`dequantize_int8_group`): a GGUF file's Q8_0, Q5_*
  and Q6_K, unpacked by ops/gguf_quants.py; the values may be packed at 5 or 6 bits (`pack_int5`, `pack_int6`).
"""

from __future__ import annotations

import math

import torch

from nanoqwen.errors import ConfigError

QUANTIZE_BLOCK_ELEMENTS = 1 << 18  # rows quantised at a time: float32 temporaries of 1 MiB
INT4_GROUP_SIZE = 64  # inputs per int4 scale and offset (module docstring)
INT4_BLOCK_ROWS = 16  # int4 rows stored lane by lane, a block at a time (module docstring)
# The zero point of a symmetric int4 matrix (no offsets): each weight is scale * (q - 8), as a GGUF file's Q4_0 holds it
SYMMETRIC_ZERO = 8
# The same for 5-bit values (dequantize_int8_group): each weight scale * (q - 16), as a GGUF file's Q5_0 holds it
SYMMETRIC_ZERO_5BIT = 16


def scale_rounded_up(s32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 scales stored in the model dtype, rounded up where rounding to nearest went down (one step of that
    dtype at most), so that the largest weight divided by its stored scale stays within the grid: no clipping."""
    s = s32.to(dtype)
    return torch.where(s.float() < s32, torch.nextafter(s, torch.tensor(float("inf"), dtype=dtype, device=s.device)), s)


@torch.no_grad()
def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [out, in] -> (int8 Wq [out, in], scale [out] in W's dtype); see the module docstring."""
    out_features, in_features = weight.shape
    dtype = weight.dtype
    q = torch.empty(out_features, in_features, dtype=torch.int8, device=weight.device)
    scale = torch.empty(out_features, dtype=dtype, device=weight.device)
    step = max(1, QUANTIZE_BLOCK_ELEMENTS // max(in_features, 1))
    # in row blocks that fit a cache: several times faster
    for start in range(0, out_features, step):
        w = weight[start: start + step]
        amax = w.abs().amax(dim=1).float()  # exact in any dtype: a max does not round
        s32 = torch.where(amax > 0, amax / 127, 1.0)
        s = scale_rounded_up(s32, dtype)  # |w / s| <= 127, no clipping
        # float32 division (out of place: a float32 weight's .float() is the weight itself).
        # Converting first is faster than dividing the bf16 block by a float32 column, which torch
        # does far slower.
        q[start: start + step] = torch.div(w.float(), s.float()[:, None]).round_().clamp_(-127, 127)
        scale[start: start + step] = s
    return q, scale


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Wq * scale in float32 [out, in]: the weight an Int8Linear computes with."""
    return q.float() * scale.float()[:, None]


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
        packed[rows], scale[rows], offset[rows] = pack_int4(q.view(-1, in_features), s, o)
    return packed, scale, offset


def pack_int4(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, *supers: torch.Tensor
              ) -> tuple[torch.Tensor | None, ...]:
    """q uint8 in 0..15 [out, in], scale and offset [out, in/G] (any dtype; offset None: symmetric, the weight
    scale * (q - SYMMETRIC_ZERO)), and any super-scales [out, ...] (two levels: quantization/int4.py) -> the int4
    format's (packed, scale, offset, *supers): two q a byte (element j low, j + G/2 high in each group), rows stored
    lane by lane in blocks of INT4_BLOCK_ROWS (the module docstring). The rows go as whole blocks: pack rows
    [16 i, 16 j) at a time."""
    out_features, in_features = q.shape
    groups = scale.shape[1]
    g = in_features // groups
    low, high = q.view(out_features, groups, 2, g // 2).unbind(2)  # elements j and j + G/2 of each group
    packed = int4_rows_to_lanes((low | (high << 4)).view(out_features, in_features // 2), 4)
    return packed, *(None if t is None else int4_rows_to_lanes(t, 1) for t in (scale, offset, *supers))


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                    super_scale: torch.Tensor | None = None, super_offset: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """offset + scale * q in float32 [out, in]: the weight an Int4Linear computes with (plain
    torch: the reference for the kernels). Any whole blocks of rows (rows [16 i, 16 j), or to the
    end) dequantise on their own. No offset (symmetric, a GGUF file's Q4_0): the offset is -SYMMETRIC_ZERO *
    scale (exact in float32). Two levels (uint8 scale and offset with super_scale and super_offset): a group's
    scale is super_scale * scale, its offset super_offset * offset (two_level_scales)."""
    packed, scale = int4_lanes_to_rows(packed, 4), int4_lanes_to_rows(scale, 1)
    if offset is None:
        if super_scale is not None:
            raise ValueError("two-level int4 scales need their offsets (only one level may omit them)")
        offset = -SYMMETRIC_ZERO * scale.float()
    else:
        offset = int4_lanes_to_rows(offset, 1)
    if super_scale is not None:
        scale = two_level_scales(scale, int4_lanes_to_rows(super_scale, 1))
        offset = two_level_scales(offset, int4_lanes_to_rows(super_offset, 1))
    out_features, groups = scale.shape
    q = torch.stack([packed & 15, packed >> 4], dim=1)  # [out, 2, in/2]: low nibbles, high nibbles
    q = q.view(out_features, 2, groups, -1).transpose(1, 2)  # [out, groups, 2, G/2]
    w = offset.float()[..., None] + scale.float()[..., None] * q.reshape(out_features, groups, -1)
    return w.view(out_features, -1)


def two_level_scales(sub: torch.Tensor, super_: torch.Tensor) -> torch.Tensor:
    """Per-group float32 values [rows, groups] from sub-values [rows, groups] (small integers) and one float32 per
    super-block of groups [rows, groups / S]: super * sub, exact in float32 for a GGUF file's."""
    return super_.repeat_interleave(sub.shape[1] // super_.shape[1], dim=1) * sub.float()


def pack_int6(q: torch.Tensor) -> torch.Tensor:
    """Values in -32..31 [rows, K] (K % 32 == 0) -> uint8 [rows, 3K/4] at 6 bits a value: each 32 in 24 bytes, 16 of
    their low nibbles (byte j: value j low, value j + 16 high) and 8 of their high 2 bits (byte b: values b, b + 8,
    b + 16, b + 24 at bits 0, 2, 4, 6), each value plus 32 (the layout int8_group_gemv reads: a GGUF file's Q6_K)."""
    rows, k = q.shape
    u = (q.to(torch.int16) + 32).to(torch.uint8).view(rows, k // 32, 32)
    low, high = u & 15, u >> 4
    nibbles = low[..., :16] | (low[..., 16:] << 4)
    h = high.view(rows, k // 32, 4, 8)  # [.., i, b]: value 8i + b
    plane = h[..., 0, :] | (h[..., 1, :] << 2) | (h[..., 2, :] << 4) | (h[..., 3, :] << 6)
    return torch.cat([nibbles, plane], dim=-1).reshape(rows, -1)


def unpack_int6(packed: torch.Tensor) -> torch.Tensor:
    """pack_int6's bytes [rows, 3K/4] -> the values, int8 [rows, K]."""
    rows = packed.shape[0]
    chunks = packed.view(rows, -1, 24)
    nibbles, plane = chunks[..., :16], chunks[..., 16:]
    low = torch.cat([nibbles & 15, nibbles >> 4], dim=-1)
    high = torch.cat([(plane >> (2 * i)) & 3 for i in range(4)], dim=-1)
    return ((low | (high << 4)).to(torch.int16) - 32).to(torch.int8).view(rows, -1)


def pack_int5(q: torch.Tensor) -> torch.Tensor:
    """Values in 0..31 [rows, K] (K % 32 == 0) -> uint8 [rows, 5K/8] at 5 bits a value: each 32 in 20 bytes, 16 of
    their low nibbles (byte j: value j low, value j + 16 high) and 4 of their fifth bits (byte i, bit b: value
    8i + b) (the layout int8_group_gemv reads: a GGUF file's Q5 types)."""
    rows, k = q.shape
    u = q.to(torch.uint8).view(rows, k // 32, 32)
    low, high = u & 15, u >> 4
    nibbles = low[..., :16] | (low[..., 16:] << 4)
    bits = high.view(rows, k // 32, 4, 8).to(torch.int32) << torch.arange(8, dtype=torch.int32, device=q.device)
    plane = bits.sum(-1).to(torch.uint8)  # (distinct bits: their sum is their or)
    return torch.cat([nibbles, plane], dim=-1).reshape(rows, -1)


def unpack_int5(packed: torch.Tensor) -> torch.Tensor:
    """pack_int5's bytes [rows, 5K/8] -> the values, int8 [rows, K] (0..31)."""
    rows = packed.shape[0]
    chunks = packed.view(rows, -1, 20)
    nibbles, plane = chunks[..., :16], chunks[..., 16:]
    low = torch.cat([nibbles & 15, nibbles >> 4], dim=-1)
    high = ((plane[..., None] >> torch.arange(8, dtype=torch.uint8, device=packed.device)) & 1).flatten(-2)
    return (low | (high << 4)).view(torch.int8).view(rows, -1)


def packed_bits(q: torch.Tensor, groups: int) -> int:
    """Bits a value of grouped int8 values q [rows, ...] with `groups` groups a row: 8 (int8 q), or the packing of
    uint8 q: a group of G values takes 5G/8 bytes (pack_int5) or 3G/4 (pack_int6), G 16 or 32, so the bytes a group
    say which (10 or 20: 5 bits; 12 or 24: 6)."""
    if q.dtype == torch.int8:
        return 8
    return 5 if (q.shape[1] // groups) % 5 == 0 else 6


def group_values(values: torch.Tensor, super_values: torch.Tensor | None) -> torch.Tensor:
    """A grouped format's scales or offsets as float32 [rows, groups]: float32 or float16 ones as they are (exact),
    or two levels, small integers times their super-block's float32 (two_level_scales)."""
    return values.float() if super_values is None else two_level_scales(values, super_values)


def dequantize_int8_group(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                          super_scale: torch.Tensor | None = None, super_offset: torch.Tensor | None = None
                          ) -> torch.Tensor:
    """q * scale + offset in float32 [out, in] (scale and offset per group of in/groups inputs): the weight an
    Int8GroupLinear computes with (quantization/int8_group.py); q int8, or uint8 packed at 5 bits (pack_int5) or 6
    (pack_int6). scale and offset float32 or float16, or two levels: small integers (int8 or uint8) with
    super_scale / super_offset, a group's value their product (group_values). 5-bit values without offsets are
    symmetric: the offset is -SYMMETRIC_ZERO_5BIT * scale (exact in float32)."""
    groups = scale.shape[1]
    bits = packed_bits(q, groups)
    if bits < 8:
        q = unpack_int5(q) if bits == 5 else unpack_int6(q)
    out_features, in_features = q.shape
    scales = group_values(scale, super_scale)
    w = q.float().view(out_features, groups, -1) * scales[..., None]
    if offset is not None:
        w = w + group_values(offset, super_offset)[..., None]
    elif bits == 5:
        w = w + (-SYMMETRIC_ZERO_5BIT * scales)[..., None]
    return w.view(out_features, in_features)


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
