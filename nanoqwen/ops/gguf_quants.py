"""GGUF's quantised block types as plain tensor functions: a tensor's blocks, as the file stores them, unpacked
into integers with a float32 scale (and offset) per group of consecutive inputs of a row. The weight is
`q * scale + offset` exactly as `gguf.quants.dequantize` (the `gguf` package's reference, after ggml-quants.c)
computes it: every scale and offset below is a float16 times a small integer, exact in float32, so the one
rounding left is the reference's own (tests/model_loader/test_gguf.py compares them bit for bit).

    type   block (weights, bytes)   group   q           scale            offset           bits a weight
    Q8_0   32, 34                   32      int8        d                -                8.5
    Q4_0   32, 18                   32      0..15       d                -8 d             4.5
    Q4_1   32, 20                   32      0..15       d                m                5.0
    Q5_0   32, 22                   32      -16..15     d                -                5.5
    Q5_1   32, 24                   32      0..31       d                m                6.0
    Q4_K   256, 144                 32      0..15       d * sc (6 bit)   -dmin * m (6 b)  4.5
    Q5_K   256, 176                 32      0..31       d * sc           -dmin * m        5.5
    Q6_K   256, 210                 16      -32..31     d * sc (int8)    -                6.5625

(d, m, dmin: float16 in the block.) The layouts within a block are ggml's: a 4-bit type's byte j holds element j
in its low nibble and element j + 16 in its high one (Q4_K/Q5_K: byte j of each 32-byte chunk holds element j of
the chunk's first sub-block and element j of its second); the fifth bit (Q5) and the two high bits (Q6_K) come from
separate bit planes. nanoqwen/quantization/prequantized.py decides which of nanoqwen's formats holds each type.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch


class GGMLType(IntEnum):
    """ggml's tensor type ids (as GGUF files store them) for the types nanoqwen reads."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30


FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
# (weights, bytes) of one block of each quantised type
BLOCK_SIZES = {GGMLType.Q8_0: (32, 34), GGMLType.Q4_0: (32, 18), GGMLType.Q4_1: (32, 20),
               GGMLType.Q5_0: (32, 22), GGMLType.Q5_1: (32, 24), GGMLType.Q4_K: (256, 144),
               GGMLType.Q5_K: (256, 176), GGMLType.Q6_K: (256, 210)}
# types whose q fits 4 bits (0..15): nanoqwen's int4 format holds them; the others its grouped int8 one
FOUR_BIT_TYPES = (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q4_K)
GROUP_SIZES = {t: 16 if t == GGMLType.Q6_K else 32 for t in BLOCK_SIZES}
SUPPORTED_TYPES = (*FLOAT_TYPES, *BLOCK_SIZES)


@dataclass(frozen=True)
class TwoLevelScales:
    """The K types' scales as the file holds them: a small integer per group (sub_scale: Q4_K's and Q5_K's 6-bit
    uint8, Q6_K's int8; sub_offset: Q4_K's and Q5_K's 6-bit mins) times a float32 per super-block of `groups` groups
    (super_scale: d; super_offset: -dmin), each [rows, ...]. scale = super_scale * sub_scale exactly (a float16
    times a small integer), so nanoqwen can hold these instead of float32 scales: 4.75 bits a Q4_K weight, not 6."""

    sub_scale: torch.Tensor
    sub_offset: torch.Tensor | None
    super_scale: torch.Tensor
    super_offset: torch.Tensor | None
    groups: int


@dataclass(frozen=True)
class GroupedWeights:
    """A matrix as integers with a scale (and offset) per group: weight = q * scale + offset.

    q [rows, cols] (uint8 for the 4- and 5-bit types with an offset, int8 otherwise), scale and offset
    [rows, cols / group] float32; offset None where the type has none (the symmetric types). two_level: the same
    scales as Q4_K and Q6_K hold them (None for the other types).
    """

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    group: int
    two_level: TwoLevelScales | None = None

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix [rows, cols]."""
        rows, cols = self.q.shape
        w = self.q.float().view(rows, -1, self.group) * self.scale[..., None]
        if self.offset is not None:
            w = w + self.offset[..., None]
        return w.view(rows, cols)

    def rows(self, start: int, end: int) -> GroupedWeights:
        """Rows [start, end) of the matrix (a tensor-parallel rank's output rows), in the same form."""
        return self._cut(0, start, end, 1)

    def columns(self, start: int, end: int) -> GroupedWeights:
        """Columns [start, end) of the matrix (a tensor-parallel rank's inputs): start and end must fall on a
        group's boundary, else a ValueError naming it. Two-level scales stay two-level where the cut falls on
        super-block boundaries too; else the share keeps the same scales as one level (float32, exact)."""
        if start % self.group or end % self.group:
            raise ValueError(f"columns [{start}, {end}) do not start and end on a boundary of {self.group} inputs "
                             f"(each group of {self.group} shares its scale)")
        return self._cut(1, start, end, self.group)

    def _cut(self, dim: int, start: int, end: int, per: int) -> GroupedWeights:
        """Every tensor's slice along dim for elements [start, end) of q (per: q's elements a scale holds there;
        the super-block values hold `groups` scales each: a cut through super-blocks keeps one level of scales)."""
        def cut(x: torch.Tensor | None, step: int) -> torch.Tensor | None:
            return None if x is None else x.narrow(dim, start // step, (end - start) // step).contiguous()

        t = self.two_level
        super_step = per * t.groups if t is not None else 1
        whole_supers = t is not None and (dim == 0 or (start % super_step == 0 and end % super_step == 0))
        two_level = None if not whole_supers else TwoLevelScales(
            cut(t.sub_scale, per), cut(t.sub_offset, per), cut(t.super_scale, per * (t.groups if dim else 1)),
            cut(t.super_offset, per * (t.groups if dim else 1)), t.groups)
        return GroupedWeights(cut(self.q, 1), cut(self.scale, per), cut(self.offset, per), self.group, two_level)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes per element at the end of b ([..., 2] uint8) as float32 [...]."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n]: the low nibbles, then the high ones."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """[..., 4] bytes (a little-endian uint32) -> [..., 32]: bit i of it at i."""
    bits = torch.arange(8, dtype=torch.uint8, device=qh.device)
    return ((qh[..., :, None] >> bits) & 1).flatten(-2)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of 6-bit sub-block scales and mins -> (sc, m), each [..., 8] (ggml's get_scale_min_k4)."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1)
    return sc.float(), mn.float()


def unpack(data: torch.Tensor, ggml_type: GGMLType | int, cols: int) -> GroupedWeights:
    """A quantised tensor's rows of blocks (uint8 [rows, cols / block weights * block bytes], as the file holds
    them) -> GroupedWeights; see the module docstring."""
    t = GGMLType(ggml_type)
    weights, nbytes = BLOCK_SIZES[t]
    rows = data.shape[0]
    b = data.reshape(rows, cols // weights, nbytes)  # [rows, blocks, bytes]
    group = GROUP_SIZES[t]
    offset: torch.Tensor | None = None
    two_level = None
    if t == GGMLType.Q8_0:
        scale, q = _f16(b[..., 0:2]), b[..., 2:].contiguous().view(torch.int8)
    elif t == GGMLType.Q4_0:
        scale = _f16(b[..., 0:2])
        q, offset = _nibbles(b[..., 2:]), -8 * scale
    elif t == GGMLType.Q4_1:
        scale, offset, q = _f16(b[..., 0:2]), _f16(b[..., 2:4]), _nibbles(b[..., 4:])
    elif t == GGMLType.Q5_0:
        scale = _f16(b[..., 0:2])
        q = (_nibbles(b[..., 6:]) | (_high_bits(b[..., 2:6]) << 4)).view(torch.int8) - 16
    elif t == GGMLType.Q5_1:
        scale, offset = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        q = _nibbles(b[..., 8:]) | (_high_bits(b[..., 4:8]) << 4)
    elif t in (GGMLType.Q4_K, GGMLType.Q5_K):
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _k_scales(b[..., 4:16])
        scale, offset = d[..., None] * sc, -(dmin[..., None] * mn)  # [rows, blocks, 8]
        # (-dmin) * m is -(dmin * m) exactly
        two_level = TwoLevelScales(sc.to(torch.uint8).reshape(rows, -1), mn.to(torch.uint8).reshape(rows, -1),
                                   d.contiguous(), (-dmin).contiguous(), 8)
        qs = b[..., -128:].reshape(rows, -1, 4, 32)  # 4 chunks of 32 bytes: sub-blocks 2c (low), 2c + 1 (high)
        q = torch.stack([qs & 15, qs >> 4], dim=3)  # [rows, blocks, 4, 2, 32]
        if t == GGMLType.Q5_K:  # bit 2c + h of qh[l]: the fifth bit of element l of sub-block 2c + h
            qh = b[..., 16:48]
            shifts = torch.arange(8, dtype=torch.uint8, device=data.device).view(4, 2, 1)
            q = q | (((qh[..., None, None, :] >> shifts) & 1) << 4)
    elif t == GGMLType.Q6_K:
        ql, qh = b[..., 0:128], b[..., 128:192]
        scales, d = b[..., 192:208].contiguous().view(torch.int8).float(), _f16(b[..., 208:210])
        scale = d[..., None] * scales  # [rows, blocks, 16]
        two_level = TwoLevelScales(scales.to(torch.int8).reshape(rows, -1), None, d.contiguous(), None, 16)
        shifts4 = torch.tensor([0, 4], dtype=torch.uint8, device=data.device).view(2, 1)
        low = ((ql.reshape(rows, -1, 2, 1, 64) >> shifts4) & 15).reshape(rows, -1, 8, 32)
        shifts2 = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=data.device).view(4, 1)
        high = ((qh.reshape(rows, -1, 2, 1, 32) >> shifts2) & 3).reshape(rows, -1, 8, 32)
        q = (low | (high << 4)).view(torch.int8) - 32
    else:  # pragma: no cover (BLOCK_SIZES names every type above)
        raise ValueError(f"no unpacking for {t.name}")
    groups = cols // group
    q = q.reshape(rows, cols)
    scale = scale.reshape(rows, groups)
    offset = None if offset is None else offset.reshape(rows, groups).contiguous()
    return GroupedWeights(q.contiguous(), scale.contiguous(), offset, group, two_level)


def row_bytes(ggml_type: GGMLType | int, cols: int) -> int:
    """Bytes of one row of `cols` weights of a quantised type."""
    weights, nbytes = BLOCK_SIZES[GGMLType(ggml_type)]
    return cols // weights * nbytes
