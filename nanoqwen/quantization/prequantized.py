"""A checkpoint's own quantised matrices (a GGUF file's, an AWQ, GPTQ or FP8 checkpoint's) in nanoqwen's formats,
unchanged: each is repacked without loss, so the model computes with exactly the weights the file holds (never a
second quantisation).

- AWQ and GPTQ 4-bit (groups of 128, an integer zero point): the int4 format with float32 scales and offsets (the
  unpacking: nanoqwen/ops/hf_quants.py); a symmetric GPTQ checkpoint's (every zero point 8) as float16 scales
  alone, the int4 format's symmetric form. GPTQ with act order (`desc_act`) multiplies its inputs in the checkpoint's
  group order (`InputOrderLinear`). FP8: fp8.py's `Fp8Linear`.

- Q4_0, Q4_1, Q4_K (q in 0..15, a scale and an offset per group of 32): the int4 format (int4.py) with group
  size 32 and the scales and offsets in float16 where that holds them exactly (Q4_1's d and m: 5 bits a weight; Q4_0's
  d alone, its offset -8 d left to the kernels as the int4 format's symmetric form: 4.5 bits, the file's), else
  float32 (`Int4Linear`; its kernels take float16 and float32 scales as well as bf16 ones); Q4_K's
  in two levels as the file holds them (6-bit sub-scales and mins, a float32 pair per 8 groups): 4.75 bits a
  weight.
- Q8_0, Q5_0, Q5_1, Q5_K, Q6_K: the grouped int8 format (int8_group.py: `Int8GroupLinear`), groups of 32 (Q6_K:
  16), scales and offsets (where the type has them) in float16 where that holds them exactly, the K types' in two
  levels as the file holds them; values that fit 5 bits (Q5_*: 0..31, Q5_0's -16..15 as q + 16 without offsets:
  the symmetric 5-bit form, 5.5 bits a weight as the file) packed at 5 bits, Q6_K's at 6: Q5_K 5.75 bits a weight
  (the file's 5.5), Q6_K 6.625 (6.5625).
- One fused matrix made of several tensors (q/k/v, gate/up) whose formats differ (a Q4_K_M file keeps attn_v of
  some layers in Q6_K beside Q4_K attn_q and attn_k): a `StackedLinear` of the runs of parts that share a format
  (q and k as one int4 matrix, v as grouped int8), their outputs side by side.

The unpacking of each type's blocks: nanoqwen/ops/gguf_quants.py. `QuantizedEmbedding` looks up token rows of a
quantised embedding table (dequantising just those rows), and its matrix is also the LM head where the file ties
them: the table is held once, in its file size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoqwen.layers.embedding import vocab_parallel_lookup
from nanoqwen.layers.experts import Experts
from nanoqwen.layers.linear import Linear
from nanoqwen.ops.cpu.matmul import MatmulPath
from nanoqwen.ops.gguf_quants import GroupedWeights, TwoLevelScales
from nanoqwen.ops.quantize import (
    INT4_BLOCK_ROWS,
    SYMMETRIC_ZERO,
    SYMMETRIC_ZERO_5BIT,
    dequantize_int4,
    dequantize_int8_group,
    pack_int4,
    pack_int5,
    pack_int6,
)
from nanoqwen.quantization.base import QuantizedLinear
from nanoqwen.quantization.fp8 import Fp8Linear
from nanoqwen.quantization.int4 import Int4Linear
from nanoqwen.quantization.int8_group import Int8GroupLinear


def is_four_bit(w: GroupedWeights) -> bool:
    """Whether the int4 format holds these weights (q in 0..15 with an offset, groups of a multiple of 16)."""
    return w.q.dtype == torch.uint8 and w.offset is not None and w.group % 16 == 0 and int(w.q.max()) < 16


def format_key(w: GroupedWeights) -> tuple:
    """What must match for matrices to be stacked into one module: the format, group size and scale layout."""
    t = w.two_level
    levels = None if t is None else (t.groups, t.sub_scale.dtype, t.sub_offset is None)
    return is_four_bit(w), w.q.dtype, w.group, w.offset is None, levels


def runs_of_one_format(parts: list[GroupedWeights]) -> list[list[GroupedWeights]]:
    """The parts in order, consecutive ones of the same format together."""
    runs: list[list[GroupedWeights]] = []
    for p in parts:
        if runs and format_key(runs[-1][-1]) == format_key(p):
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


class StackedLinear(nn.Module):
    """A fused linear (q/k/v, gate/up) whose parts a checkpoint holds in different formats: each run of parts of
    one format as its own quantised linear, their outputs side by side: y = [part_0(x), part_1(x), ...]."""

    def __init__(self, parts: list[QuantizedLinear], output_sizes: list[int]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.output_sizes = output_sizes
        self.bias = None

    @property
    def weight(self) -> torch.Tensor:
        return self.parts[0].weight

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def fused_linear(linear: Linear, parts: list[GroupedWeights]) -> nn.Module:
    """The quantised version of a fused `linear` from its parts in order: one module where they share a format,
    else a StackedLinear."""
    runs = runs_of_one_format(parts)
    if len(runs) == 1:
        return quantized_linear(linear, concat_parts(runs[0]))
    modules = []
    for run in runs:
        with torch.device("meta"):  # (only its class and attributes are used)
            template = Linear(run[0].q.shape[1], sum(p.q.shape[0] for p in run))
        template.matmul_path = linear.matmul_path
        modules.append(quantized_linear(template, concat_parts(run)))
    return StackedLinear(modules, list(linear.output_sizes))


def concat_parts(parts: list[GroupedWeights]) -> GroupedWeights:
    """The parts' rows one after another, in one format: as they are where they share it, else every part as
    grouped int8 with the smallest group size (module docstring)."""
    if len(parts) == 1:
        return parts[0]
    four_bit = all(is_four_bit(p) for p in parts)
    group = min(p.group for p in parts)

    def regroup(t: torch.Tensor, p: GroupedWeights) -> torch.Tensor:
        return t.repeat_interleave(p.group // group, dim=1)

    def q_of(p: GroupedWeights) -> torch.Tensor:
        return p.q if four_bit or p.q.dtype == torch.int8 else p.q.to(torch.int8)  # 0..31 fits int8

    offsets = None
    if any(p.offset is not None for p in parts):
        offsets = torch.cat([regroup(p.offset if p.offset is not None else torch.zeros_like(p.scale), p)
                             for p in parts])
    two_level = None
    levels = [p.two_level for p in parts]
    if all(t is not None for t in levels) and len({(t.groups, t.sub_scale.dtype, t.sub_offset is None, p.group)
                                                    for t, p in zip(levels, parts, strict=True)}) == 1:
        def cat(name: str) -> torch.Tensor | None:
            values = [getattr(t, name) for t in levels]
            return None if values[0] is None else torch.cat(values)

        two_level = TwoLevelScales(cat("sub_scale"), cat("sub_offset"), cat("super_scale"), cat("super_offset"),
                                   levels[0].groups)
    return GroupedWeights(torch.cat([q_of(p) for p in parts]), torch.cat([regroup(p.scale, p) for p in parts]),
                          offsets, group, two_level)


def quantized_linear(linear: Linear, w: GroupedWeights) -> QuantizedLinear:
    """The quantised version of `linear` holding w (its shape: the linear's)."""
    t = w.two_level
    if is_four_bit(w):
        if t is not None:  # Q4_K: its 6-bit scales and mins with their float32 super-block pair
            return Int4Linear.from_buffers(linear, *pack_int4(w.q, t.sub_scale, t.sub_offset, t.super_scale,
                                                              t.super_offset))
        scale = as_float16_if_exact(w.scale)
        if torch.equal(w.offset, -SYMMETRIC_ZERO * w.scale):  # symmetric (Q4_0, GPTQ's sym): no offsets held
            return Int4Linear.from_buffers(linear, *pack_int4(w.q, scale, None))
        offset = as_float16_if_exact(w.offset)
        if scale.dtype != offset.dtype:  # (the int4 kernels take them in one dtype)
            scale, offset = w.scale, w.offset
        return Int4Linear.from_buffers(linear, *pack_int4(w.q, scale, offset))
    five = five_bit(w)
    if five is not None:
        w, t = five, five.two_level
        q = pack_int5(w.q)
        if t is None and torch.equal(w.offset, -SYMMETRIC_ZERO_5BIT * w.scale):  # Q5_0: no offsets held
            return Int8GroupLinear.from_buffers(linear, q, as_float16_if_exact(w.scale), None, None, None)
    else:
        q = w.q if w.q.dtype == torch.int8 else w.q.to(torch.int8)
        if t is not None and t.sub_offset is None and t.sub_scale.dtype == torch.int8 and t.groups == 16:  # Q6_K
            return Int8GroupLinear.from_buffers(linear, pack_int6(q), t.sub_scale, None, t.super_scale, None)
        if t is None and q.shape[1] % 32 == 0 and -32 <= int(q.min()) and int(q.max()) < 32:
            q = pack_int6(q)  # (Q6_K's values with one level of scales: a tensor-parallel share, model_loader/sharding)
    if t is not None and (w.offset is None) == (t.sub_offset is None):  # two levels, as the file holds them
        return Int8GroupLinear.from_buffers(linear, q, t.sub_scale, t.sub_offset, t.super_scale, t.super_offset)
    return Int8GroupLinear.from_buffers(linear, q, as_float16_if_exact(w.scale),
                                        None if w.offset is None else as_float16_if_exact(w.offset), None, None)


def five_bit(w: GroupedWeights) -> GroupedWeights | None:
    """w with its values as uint8 0..31 where they fit 5 bits (Q5_1's and Q5_K's as they are; Q5_0's -16..15 as
    q + 16, with the offset -16 scale, exact), else None."""
    if w.group % 16:
        return None
    low, high = int(w.q.min()), int(w.q.max())
    if 0 <= low and high < 32 and w.offset is not None:  # (5-bit values without offsets are symmetric ones)
        return GroupedWeights(w.q.to(torch.uint8), w.scale, w.offset, w.group, w.two_level)
    if -16 <= low and high < 16 and w.offset is None and w.two_level is None:
        return GroupedWeights((w.q.to(torch.int16) + 16).to(torch.uint8), w.scale, -16 * w.scale, w.group)
    return None


def as_float16_if_exact(values: torch.Tensor) -> torch.Tensor:
    """float32 values as float16 where that holds every one exactly (a GGUF file's d and m), else as they are."""
    half = values.half()
    return half if torch.equal(half.float(), values) else values


class InputOrderLinear(nn.Module):
    """A quantised linear whose groups run over its inputs in another order (GPTQ's act order): y = inner(x[...,
    input_order]), the same product as the checkpoint's matrix times x."""

    def __init__(self, inner: QuantizedLinear, input_order: torch.Tensor) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("input_order", input_order)
        for name in ("output_sizes", "tp_size"):  # what the model reads of a (tensor-parallel) linear
            if hasattr(inner, name):
                setattr(self, name, getattr(inner, name))

    @property
    def bias(self) -> torch.Tensor | None:
        return self.inner.bias

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.index_select(-1, self.input_order))


def fp8_linear(linear: Linear, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> QuantizedLinear:
    """The Fp8Linear version of `linear` from its parts' (weight float8 [n, K], scales [n, K / bk]: the checkpoint's
    scale_inv one row per weight row) in order: their rows stacked."""
    weights = torch.cat([w for w, _ in parts])
    scales = torch.cat([s for _, s in parts])
    return Fp8Linear.from_buffers(linear, weights, scales.float().contiguous())


class CheckpointExperts(Experts):
    """Qwen3-MoE experts as a checkpoint holds them: expert e's gate_up_proj and down_proj each a quantised linear
    of its own (`gate_up_proj_experts[e]`, `down_proj_experts[e]`), in the format its matrix came in (a Q4_K_M
    file's Q4_K gate/up and Q6_K down, two-level scales and 6-bit values included)."""

    def __init__(self, matrices: dict[str, list[GroupedWeights]], matmul_path: MatmulPath) -> None:
        nn.Module.__init__(self)  # not Experts.__init__: no model-dtype parameters to allocate
        for name, ws in matrices.items():
            linears = []
            for w in ws:
                with torch.device("meta"):  # (only its class and attributes are used)
                    template = Linear(w.q.shape[1], w.q.shape[0], matmul=matmul_path)
                linears.append(quantized_linear(template, w))
            setattr(self, f"{name}_experts", nn.ModuleList(linears))
        self.matmul_path = matmul_path

    @property
    def num_experts(self) -> int:
        return len(self.gate_up_proj_experts)

    def expert_linear(self, x: torch.Tensor, name: str, e: int) -> torch.Tensor:
        return getattr(self, f"{name}_experts")[e].matmul(x, None)


class QuantizedEmbedding(nn.Module):
    """An embedding table held in a quantised format (`table`: an Int4Linear or Int8GroupLinear [V, H]): a lookup
    dequantises just the rows it reads, to `dtype`. `weight` is the table's matrix, so a tied LM head (the same
    `table` module) is recognised as tied. With tp_size > 1 the table is this rank's rows [vocab_start,
    vocab_start + V/tp) of the vocabulary, looked up as VocabParallelEmbedding does (nanoqwen/layers/embedding.py:
    zeros for the other ranks' ids, one all_reduce)."""

    def __init__(self, table: QuantizedLinear, dtype: torch.dtype, vocab_start: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.table = table
        self.dtype = dtype
        self.tp_size = tp_size
        self.vocab_start, self.vocab_end = vocab_start, vocab_start + table.out_features

    @property
    def weight(self) -> torch.Tensor:
        return self.table.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.lookup(input_ids)
        return vocab_parallel_lookup(input_ids, self.vocab_start, self.vocab_end, self.lookup)

    def lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The table's rows `input_ids` (of this rank's table) in `dtype` [len(input_ids), H]."""
        t = self.table
        if isinstance(t, Int4Linear):  # rows stored lane by lane in blocks of 16: dequantise each id's block
            n, rows = t.weight.shape[0], INT4_BLOCK_ROWS
            blocks = input_ids // rows
            full = n // rows * rows  # ids in the last, partial block take it whole
            if bool((input_ids >= full).any()) or n % rows:
                w = dequantize_int4(t.weight, t.scale, t.offset, *t.supers())
                return F.embedding(input_ids, w).to(self.dtype)
            pick = lambda b: None if b is None else b.view(n // rows, -1)[blocks].view(-1, b.shape[1])  # noqa: E731
            w = dequantize_int4(*(pick(b) for b in (t.weight, t.scale, t.offset, *t.supers())))
            w = w.view(-1, rows, 2 * t.weight.shape[1])
            return w[torch.arange(len(input_ids), device=input_ids.device), input_ids % rows].to(self.dtype)
        pick = lambda b: None if b is None else b[input_ids]  # noqa: E731 (the ids' rows)
        return dequantize_int8_group(*(pick(b) for b in (t.weight, t.scale, t.offset, t.super_scale, t.super_offset))
                                     ).to(self.dtype)
