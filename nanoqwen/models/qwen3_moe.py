"""Qwen3-MoE's sparse MLP block: a router picks K of E SwiGLU experts per token (as transformers'
Qwen3MoeSparseMoeBlock does). models/qwen3.py uses it in the layers that config.is_moe_layer(i) names.

Shapes: N tokens, H = hidden_size, E = num_experts, K = num_experts_per_tok, Ie = moe_intermediate_size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoqwen.config import Qwen3Config
from nanoqwen.distributed import all_reduce
from nanoqwen.models.qwen3 import Linear


def experts_reference(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                      expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The definition, token by token: out[n] = sum_k weights[n, k] * expert_{expert_ids[n, k]}(x[n]).

    x [N, H]; gate_up_proj [E, 2Ie, H]; down_proj [E, H, Ie]; expert_ids, weights [N, K] -> [N, H].
    Every token's K experts' matrices are gathered ([N, K, 2Ie, H]): clear, but too big for real use.
    """
    gate, up = torch.einsum("nkjh,nh->nkj", gate_up_proj[expert_ids], x).chunk(2, dim=-1)  # [N, K, Ie] each
    out = torch.einsum("nkhi,nki->nkh", down_proj[expert_ids], F.silu(gate) * up)  # [N, K, H]
    return (out * weights[..., None]).sum(1)


class Experts(nn.Module):
    """E SwiGLU MLPs, stacked: gate_up_proj [E, 2Ie, H] (each expert's gate rows, then its up rows), down_proj
    [E, H, Ie]. Tensor parallelism splits every expert over Ie, like the dense MLP over I: a rank holds
    Ie/tp of each expert's columns ([gate_r; up_r] rows, the matching down_proj columns)."""

    def __init__(self, config: Qwen3Config, tp_size: int = 1) -> None:
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size // tp_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, h, i), requires_grad=False)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """experts_reference, grouped by expert: x [N, H]; expert_ids, weights [N, K] -> [N, H].

        The N*K (token, expert) assignments are sorted by expert, so each expert that got tokens runs
        one matmul pair over all of its tokens; results are weighted and added back to their tokens.
        """
        k = expert_ids.shape[1]
        order = expert_ids.flatten().argsort(stable=True)  # [N*K] assignments, grouped by expert
        tokens = order // k  # [N*K] the token of each sorted assignment
        xs, ws = x[tokens], weights.flatten()[order, None]  # [N*K, H], [N*K, 1]
        counts = torch.bincount(expert_ids.flatten(), minlength=len(self.gate_up_proj)).tolist()
        out = torch.zeros_like(x)
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            rows = slice(start, start + count)
            start += count
            gate, up = self.expert_linear(xs[rows], "gate_up_proj", e).chunk(2, dim=-1)  # [count, Ie] each
            y = self.expert_linear(F.silu(gate) * up, "down_proj", e)  # [count, H]
            out.index_add_(0, tokens[rows], y * ws[rows])
        return out

    def expert_linear(self, x: torch.Tensor, name: str, e: int) -> torch.Tensor:
        """x [n, in] through expert e's matrix `name` (gate_up_proj or down_proj) -> [n, out]. The one place
        that reads the matrices: int8 experts (quantization.py) override it."""
        return F.linear(x, getattr(self, name)[e])


class SparseMoeBlock(nn.Module):
    """Route each token to its top-K of E experts and sum their outputs, weighted by the router."""

    def __init__(self, config: Qwen3Config, tp_size: int = 1) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob, self.tp_size = config.num_experts_per_tok, config.norm_topk_prob, tp_size
        self.gate = Linear(config.hidden_size, config.num_experts)  # the router, whole on every rank
        self.experts = Experts(config, tp_size)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (expert ids [N, K], weights [N, K] in x's dtype), computed as transformers does."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [N, E]
        weights, expert_ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return expert_ids, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, *self.route(x))  # with tp_size > 1 this rank's share of every expert's output
        return all_reduce(out) if self.tp_size > 1 else out
