"""LoRA on the base model's projections, added from outside the model: each adapted linear (the fused qkv_proj
and gate_up_proj, o_proj, down_proj) gets a forward hook that adds, row by row of the flat batch, its adapter's
product to what the base layer computed:

    y[n] = base(x)[n] + (x[n] @ A_s^T) @ B_s^T      for row n of an adapter in slot s (scaling folded into B)

A fused projection stacks its parts' outputs ([q; k; v], [gate; up]), so each part p has its own A_{s,p} and
B_{s,p}, which fill only that part's output columns. `LoRALayer` holds every slot's A and B of one linear,
padded to max_lora_rank with zeros (a padded rank adds exact zeros), laid out so that all slots and parts are
two matrices:

    lora_a   [S * P * R, in]    row (s, p, r): A_{s,p}[r]
    lora_b   [out, S * P * R]   column (s, p, r): scaling * B_{s,p}[:, r] in part p's output rows, zero elsewhere

Which rows run with which slot is the step's `LoRAStep`, set by the engine's LoRAManager before each forward
(the model runner gives it each row's adapter, as it gives attention its metadata). Three ways to add the
products, all the same sums:
- reference: one row group (the rows of one slot) at a time, one part at a time: the definition.
- batched: u = x @ lora_a^T for every slot at once, each row's other slots' columns zeroed, then u @ lora_b^T.
  No host work per group and no gather of weights per row; it costs S * P * R columns, a few percent of the
  base matmul for small S * R.
- one slot for every row (a batch of one adapter): x @ lora_a[s]^T @ lora_b[s]^T, with B kept a second time as
  one contiguous [out, P * R] matrix a slot.

With tensor parallelism each rank holds its shard of every slot's A and B, cut as its base linear is
(layers/linear.py): a column-parallel linear (qkv_proj, gate_up_proj) keeps 1/tp of each part's output rows, so
each part's B keeps the same rows (B_p[rank * out_p/tp: (rank + 1) * out_p/tp], the loader's cut of that part's
weight) and A is whole; a row-parallel linear (o_proj, down_proj) keeps 1/tp of its input columns, so A keeps
the same columns and B is whole. There the product of this rank's columns, x_shard @ A_shard^T @ B^T, is a part
of the sum just as the base layer's output is (the sum over ranks of x_r A_r^T is x A^T): the hook adds it
before the layer's all_reduce (RowParallelLinear.partial_sum_hook), whose one all_reduce sums both.

Both matmul paths go through the linear's own matmul path (weights [out, in], as a Linear's: on CPUs
nanoqwen's gemv kernels for few rows). The fused CPU decoder (worker/fused_decoder.py) adds the one-slot products
of a decode step whose rows all use one adapter in C++, from the same matrices through the same kernels
(LoRAManager.fused_decoder_weights).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from nanoqwen.lora.peft import LoRAWeights
from nanoqwen.ops.cpu.matmul import TORCH_MATMUL, MatmulPath
from nanoqwen.quantization.prequantized import StackedLinear


@dataclass
class LoRAStep:
    """The adapters of the forward that runs now, row by row of the flat batch (all empty: no adapter).

    slots: each row's slot (-1: the base model alone) [N] on the device; one_hot [N, S] in the model's dtype;
    groups: (slot, row indices) per slot used; uniform_slot: the slot of every row, when they all share one;
    reference: use the per-group loop (the definition) instead of the batched matmuls.
    """

    slots: torch.Tensor | None = None
    one_hot: torch.Tensor | None = None
    groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    uniform_slot: int | None = None
    reference: bool = False

    @property
    def active(self) -> bool:
        return bool(self.groups)


def matmul_path(module: nn.Module) -> MatmulPath:
    """How an adapted linear's products run (its CPU kernels): its own matmul path, a stack of parts' first part's
    (StackedLinear), else torch's."""
    if isinstance(module, StackedLinear):
        return matmul_path(module.parts[0])
    return getattr(module, "matmul_path", TORCH_MATMUL)


class LoRALayer:
    """Every slot's LoRA A and B of one linear of the model, and the forward hook that adds their products.

    in_features, part_sizes: the whole linear's input size and output parts (qkv_proj: [q, k, v] sizes; o_proj:
    [out]); step: the engine's LoRAStep, shared by all of its layers. With tp_size > 1 it holds this rank's shard
    (module docstring): 1/tp of each part's output rows, or of the input columns where row_parallel."""

    def __init__(self, in_features: int, part_sizes: list[int], max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device, step: LoRAStep, tp_rank: int = 0, tp_size: int = 1,
                 row_parallel: bool = False) -> None:
        self.tp_rank, self.tp_size, self.row_parallel = tp_rank, tp_size, row_parallel
        if row_parallel:
            in_features //= tp_size
        else:
            part_sizes = [size // tp_size for size in part_sizes]
        self.part_sizes = part_sizes
        self.part_offsets = [sum(part_sizes[:p]) for p in range(len(part_sizes))]
        self.num_parts, self.max_rank, self.max_loras = len(part_sizes), max_rank, max_loras
        self.step = step
        rows = max_loras * self.num_parts * max_rank
        self.lora_a = torch.zeros(rows, in_features, dtype=dtype, device=device)
        self.lora_b = torch.zeros(sum(part_sizes), rows, dtype=dtype, device=device)
        # the same B, one [out, P * R] matrix a slot (a weight's layout, for the linear's own matmul path)
        self.lora_b_by_slot = torch.zeros(max_loras, sum(part_sizes), self.num_parts * max_rank, dtype=dtype,
                                          device=device)

    def rows(self, slot: int, part: int | None = None) -> slice:
        """The rows of lora_a and lora_b of a slot (all its parts), or of one part of it."""
        per_slot = self.num_parts * self.max_rank
        if part is None:
            return slice(slot * per_slot, (slot + 1) * per_slot)
        start = slot * per_slot + part * self.max_rank
        return slice(start, start + self.max_rank)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[self.rows(slot)] = 0
        self.lora_b[:, self.rows(slot)] = 0
        self.lora_b_by_slot[slot] = 0

    def shard(self, weights: LoRAWeights) -> LoRAWeights:
        """This rank's shard of one part's whole A [r, in] and B [out_p, r] (themselves at tp_size 1): the
        columns of A a row-parallel linear keeps, else the rows of B a column-parallel one keeps."""
        if self.tp_size == 1:
            return weights
        a, b = weights.lora_a, weights.lora_b
        if self.row_parallel:
            n = a.shape[1] // self.tp_size
            return weights._replace(lora_a=a[:, self.tp_rank * n: (self.tp_rank + 1) * n])
        n = b.shape[0] // self.tp_size
        return weights._replace(lora_b=b[self.tp_rank * n: (self.tp_rank + 1) * n])

    def set_part(self, slot: int, part: int, weights: LoRAWeights) -> None:
        """Write one part's adapter (whole, as read: this rank keeps its shard of it) into a slot (the slot was
        cleared first)."""
        weights = self.shard(weights)
        r = weights.lora_a.shape[0]
        rows = self.rows(slot, part)
        start, size = self.part_offsets[part], self.part_sizes[part]
        self.lora_a[rows.start: rows.start + r] = weights.lora_a.to(self.lora_a.dtype)
        scaled_b = (weights.lora_b * weights.scaling).to(self.lora_b.dtype)  # [out_p, r]
        self.lora_b[start: start + size, rows.start: rows.start + r] = scaled_b
        first = part * self.max_rank  # (its columns in the slot's matrix)
        self.lora_b_by_slot[slot, start: start + size, first: first + r] = scaled_b

    def hook(self, module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor | None:
        """The forward hook: the base output plus the adapters' products (None, the output unchanged, when no
        row of the step has an adapter). On a row-parallel linear with tp_size > 1 it is the linear's
        partial_sum_hook instead: output is this rank's part of the sum, and so is what it adds."""
        step = self.step
        if not step.active:
            return None
        x = inputs[0]
        if step.reference:
            return self.add_reference(x, output)
        linear = matmul_path(module).linear  # (its CPU kernels)
        if step.uniform_slot is not None:  # two thin products
            u = linear(x, self.lora_a[self.rows(step.uniform_slot)])  # [N, P*R]
            return output + linear(u, self.lora_b_by_slot[step.uniform_slot])
        return self.add_batched(x, output, linear)

    def add_reference(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The definition: for each slot's rows, for each part, y[rows, part] += (x[rows] @ A^T) @ B^T."""
        y = y.clone()
        for slot, rows in self.step.groups:
            xs = x[rows]
            delta = torch.zeros(len(rows), y.shape[-1], dtype=y.dtype, device=y.device)
            for part, (start, size) in enumerate(zip(self.part_offsets, self.part_sizes, strict=True)):
                r = self.rows(slot, part)
                delta[:, start: start + size] = (xs @ self.lora_a[r].t()) @ self.lora_b[start: start + size, r].t()
            y.index_add_(0, rows, delta)
        return y

    def add_batched(self, x: torch.Tensor, y: torch.Tensor,
                    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear) -> torch.Tensor:
        """Every row's adapter in two matmuls over all slots: u = x @ lora_a^T [N, S*P*R], each row keeping only
        its slot's columns (one_hot), then y + u @ lora_b^T."""
        u = linear(x, self.lora_a).view(x.shape[0], self.max_loras, -1)
        u = (u * self.step.one_hot[:, :, None]).view(x.shape[0], -1)
        return y + linear(u, self.lora_b)
