"""The Qwen3 decoder (dense and MoE), written from plain tensor operations.

Read top to bottom: RMSNorm -> linear layers -> RoPE -> attention (QK-norm, GQA) -> SwiGLU MLP or
sparse MoE block -> decoder layer -> the whole model. It computes what transformers'
Qwen3ForCausalLM and Qwen3MoeForCausalLM compute.

Two layout choices, both made so one batch can mix sequences of different lengths:
- Tokens are flat: a batch of sequences is one [num_tokens, hidden] tensor, so every matmul
  runs once over all tokens with no padding. Only attention needs to know where each
  sequence starts; `AttentionMetadata` (nanoqwen/engine/attention_metadata.py) tells it.
- The checkpoint's q/k/v projections are stored as one `qkv_proj` matrix and gate/up as one
  `gate_up_proj` (stacked at load time), so each layer does two big matmuls instead of five.

Shapes: N = tokens in the batch, H = hidden_size, Hq/Hkv = query/key-value heads,
D = head_dim, I = intermediate_size, V = vocab_size; MoE: E = num_experts, K = num_experts_per_tok,
Ie = moe_intermediate_size.

Tensor parallelism (tp_size ranks, nanoqwen/distributed.py) lives in the layers that are cut:
`ColumnParallelLinear` holds 1/tp of the output rows (qkv_proj: Hq/tp query and Hkv/tp key-value
heads; gate_up_proj: I/tp MLP columns; the LM head: V/tp vocabulary rows), `RowParallelLinear` the
matching 1/tp of the input columns (o_proj, down_proj), so its output is this rank's part of a sum
and it adds the parts with one all_reduce. MoE experts are cut the same way over Ie (the router is
whole on every rank, so all ranks pick the same experts), with one all_reduce after the expert sum;
the embedding is cut over the vocabulary. Each such module's `tp_dims` says which dimension of which
parameter is cut (the loader reads only that slice). So a layer costs two all_reduce calls, the only
places ranks talk; at tp_size 1 every all_reduce is skipped: the plain model.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from nanoqwen.config import Qwen3Config
from nanoqwen.distributed import all_reduce, check_tensor_parallel_size, gather
from nanoqwen.ops.attention import attend

if TYPE_CHECKING:
    from nanoqwen.engine.attention_metadata import AttentionMetadata
    from nanoqwen.engine.kv_cache import KVCache


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, normalised in float32 like transformers."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


class Linear(nn.Module):
    """y = x @ weight.T + bias; weight [out, in], filled by the loader. Whole on every rank (tp_dims
    empty).

    `matmul` is the one place that reads the weight: weight-only int8 and int4
    (nanoqwen/quantization/: base.py's QuantizedLinear) override it.
    """

    # parameter -> the dimension tensor parallelism cuts (the loader reads it)
    tp_dims: dict[str, int] = {}

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return kernels.linear(x, self.weight, bias)  # F.linear (see Kernels below)


class ColumnParallelLinear(Linear):
    """A Linear whose output rows are cut over the ranks: each holds 1/tp of every part of
    `output_sizes` (qkv_proj: [q; k; v], gate_up_proj: [gate; up]), stacked [part_0 of this rank;
    part_1 of this rank; ...]. Nothing to add up: each rank's outputs are its own heads or
    columns."""

    tp_dims = {"weight": 0, "bias": 0}

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 tp_size: int = 1) -> None:
        self.output_sizes = [size // tp_size for size in output_sizes]  # this rank's part of each
        super().__init__(in_features, sum(self.output_sizes), bias)


class RowParallelLinear(Linear):
    """A Linear whose input columns are cut over the ranks (the ones a ColumnParallelLinear before
    it left on this rank): its output is this rank's part of a sum, and all_reduce adds the parts.
    The bias must be added once, so only rank 0 has one (as in vLLM)."""

    tp_dims = {"weight": 1}
    # parameters the other ranks do not have (the loader skips them there)
    tp_rank0_only = ("bias",)

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        super().__init__(in_features // tp_size, out_features, bias and tp_rank == 0)
        self.tp_size = tp_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.bias)  # [N, out]: this rank's part of the sum
        return all_reduce(y) if self.tp_size > 1 else y


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


def rope_inv_freq(config: Qwen3Config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [D/2] and the cos/sin scale, for default RoPE or YaRN."""
    dim, base = config.head_dim, config.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv_freq = 1.0 / pos_freqs
    if config.rope_scaling is None:
        return inv_freq, 1.0
    # YaRN: interpolate the low frequencies by `factor`, keep the high ones, ramp in between.
    s = config.rope_scaling
    factor, original_len = s["factor"], s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(original_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)
    scale = s.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return inv_freq, float(scale)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with cos/sin precomputed for every position up to max_len."""

    def __init__(self, config: Qwen3Config, max_len: int) -> None:
        super().__init__()
        inv_freq, scale = rope_inv_freq(config)
        freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [L, D/2]
        angles = torch.cat([freqs, freqs], dim=-1)  # [L, D]: both halves use the same angle
        self.register_buffer("cos", angles.cos() * scale, persistent=False)
        self.register_buffer("sin", angles.sin() * scale, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # [N, D] each, in the activation dtype as transformers casts them
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, D]; cos/sin [N, D], shared by every head."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [N, 2I] (gate and up stacked) -> [N, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class Kernels:
    """The functions the layers call for their elementwise math and their matmuls. An engine may
    swap in faster versions of the same functions (nanoqwen/compilation.py): torch.compile'd
    elementwise kernels (one fused kernel each), and on CPUs without fast bf16 a matmul computed in
    float32 (nanoqwen/ops/cpu.py). These plain ones stay the reference."""

    rms_norm = staticmethod(rms_norm)
    apply_rope = staticmethod(apply_rope)
    swiglu = staticmethod(swiglu)
    linear = staticmethod(F.linear)


kernels = Kernels()


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
                        ) -> torch.Tensor:
    """Grouped-query attention, the documented reference path.

    q [B, Hq, T, D]; k, v [B, Hkv, S, D]; mask [B or 1, 1, T, S] bool (True = may attend) or None.
    Each group of Hq/Hkv query heads shares one key/value head: the query heads are viewed as
    [B, Hkv, G, T, D] so K/V broadcast over G and are never repeated in memory.
    """
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    qg = q.view(b, hkv, hq // hkv, t, d)
    scores = (qg @ k.unsqueeze(2).transpose(-1, -2)) * d**-0.5  # [B, Hkv, G, T, S]
    if mask is not None:
        scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return (probs @ v.unsqueeze(2)).view(b, hq, t, d)


class Attention(nn.Module):
    """QK-norm grouped-query attention. With tp_size > 1 this rank's heads: whole GQA groups, so
    each query head finds its key/value head on the same rank."""

    def __init__(self, config: Qwen3Config, layer_idx: int, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads // tp_size
        self.num_kv_heads = config.num_key_value_heads // tp_size
        q_size = config.num_attention_heads * self.head_dim
        kv_size = config.num_key_value_heads * self.head_dim
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, [q_size, kv_size, kv_size],
                                             config.attention_bias, tp_size)
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, config.attention_bias,
                                        tp_rank, tp_size)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)  # per head, before RoPE
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        q = self.q_norm(q.view(n, self.num_heads, self.head_dim))  # [N, Hq, D]
        k = self.k_norm(k.view(n, self.num_kv_heads, self.head_dim))  # [N, Hkv, D]
        v = v.view(n, self.num_kv_heads, self.head_dim)  # [N, Hkv, D]
        q, k = kernels.apply_rope(q, cos, sin), kernels.apply_rope(k, cos, sin)
        out = attend(q, k, v, kv_cache, self.layer_idx, meta)  # [N, Hq, D]: ops/attention.py
        return self.o_proj(out.view(n, -1))  # [N, H]


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up stacked in one matrix [2I, H].

    With tp_size > 1 a rank holds I/tp of the columns: [gate_r; up_r] rows and the matching
    down_proj columns.
    """

    def __init__(self, config: Qwen3Config, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        i = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [i, i], tp_size=tp_size)
        self.down_proj = RowParallelLinear(i, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [N, 2I/tp] -> [N, I/tp] -> [N, H]
        return self.down_proj(kernels.swiglu(self.gate_up_proj(x)))


# ---- Qwen3-MoE: a router picks K of E SwiGLU experts per token
# (transformers' Qwen3MoeSparseMoeBlock)


def experts_reference(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                      expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The definition, token by token:
    out[n] = sum_k weights[n, k] * expert_{expert_ids[n, k]}(x[n]).

    x [N, H]; gate_up_proj [E, 2Ie, H]; down_proj [E, H, Ie]; expert_ids, weights [N, K] -> [N, H].
    Every token's K experts' matrices are gathered ([N, K, 2Ie, H]): clear, but too big for
    real use.
    """
    # [N, K, Ie] each
    gate, up = torch.einsum("nkjh,nh->nkj", gate_up_proj[expert_ids], x).chunk(2, dim=-1)
    out = torch.einsum("nkhi,nki->nkh", down_proj[expert_ids], F.silu(gate) * up)  # [N, K, H]
    return (out * weights[..., None]).sum(1)


class Experts(nn.Module):
    """E SwiGLU MLPs, stacked: gate_up_proj [E, 2Ie, H] (each expert's gate rows, then its up rows),
    down_proj [E, H, Ie]. Tensor parallelism splits every expert over Ie, like the dense MLP over I:
    a rank holds Ie/tp of each expert's columns ([gate_r; up_r] rows, the matching down_proj
    columns)."""

    tp_dims = {"gate_up_proj": 1, "down_proj": 2}
    # A checkpoint tensor that fills all of gate_up_proj (transformers 5's fused experts) holds the
    # gate rows, then the up rows, along the cut dimension: the loader cuts each of the 2 parts on
    # its own.
    tp_fused_parts = {"gate_up_proj": 2}

    def __init__(self, config: Qwen3Config, tp_size: int = 1) -> None:
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size // tp_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, h, i), requires_grad=False)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
        """experts_reference, grouped by expert: x [N, H]; expert_ids, weights [N, K] -> [N, H].

        The N*K (token, expert) assignments are sorted by expert, so each expert that got tokens
        runs one matmul pair over all of its tokens; results are weighted and added back to their
        tokens.
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
            # [count, Ie] each
            gate, up = self.expert_linear(xs[rows], "gate_up_proj", e).chunk(2, dim=-1)
            y = self.expert_linear(F.silu(gate) * up, "down_proj", e)  # [count, H]
            out.index_add_(0, tokens[rows], y * ws[rows])
        return out

    def expert_linear(self, x: torch.Tensor, name: str, e: int) -> torch.Tensor:
        """x [n, in] through expert e's matrix `name` (gate_up_proj or down_proj) -> [n, out]. The
        one place that reads the matrices: int8 and int4 experts (quantization/int8.py, int4.py) override it."""
        return kernels.linear(x, getattr(self, name)[e])


class SparseMoeBlock(nn.Module):
    """Route each token to its top-K of E experts and sum their outputs, weighted by the router."""

    def __init__(self, config: Qwen3Config, tp_size: int = 1) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.tp_size = tp_size
        # the router, whole on every rank
        self.gate = Linear(config.hidden_size, config.num_experts)
        self.experts = Experts(config, tp_size)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (expert ids [N, K], weights [N, K] in x's dtype), computed as transformers
        does."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [N, E]
        weights, expert_ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return expert_ids, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # with tp_size > 1 this rank's part of every expert's sum, as in RowParallelLinear
        out = self.experts(x, *self.route(x))  # [N, H]
        return all_reduce(out) if self.tp_size > 1 else out


class DecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx, tp_rank, tp_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        moe = config.is_moe_layer(layer_idx)
        self.mlp = SparseMoeBlock(config, tp_size) if moe else MLP(config, tp_rank, tp_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class VocabParallelEmbedding(nn.Module):
    """The embedding table; with tp_size > 1 only rows [vocab_start, vocab_end) of it, on this
    rank."""

    tp_dims = {"weight": 0}

    def __init__(self, vocab_size: int, hidden_size: int, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        super().__init__()
        rows = vocab_size // tp_size
        self.tp_size = tp_size
        self.vocab_start, self.vocab_end = tp_rank * rows, (tp_rank + 1) * rows
        self.weight = nn.Parameter(torch.empty(rows, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        # Each rank looks up the ids in its range and gives zeros for the others: the sum is every
        # id's row.
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        x = F.embedding(torch.where(mine, input_ids - self.vocab_start, 0), self.weight)
        return all_reduce(x.masked_fill_(~mine[:, None], 0))


class Qwen3ForCausalLM(nn.Module):
    """Embedding -> decoder layers -> final norm; `compute_logits` applies the LM head.

    tp_rank/tp_size: build only this rank's shard of every weight (see the module docstring).
    lm_head=False: no LM head (an embedding model reads the final hidden states only).
    """

    def __init__(self, config: Qwen3Config, max_model_len: int | None = None, tp_rank: int = 0,
                 tp_size: int = 1, lm_head: bool = True) -> None:
        super().__init__()
        check_tensor_parallel_size(config, tp_size)
        self.config, self.tp_rank, self.tp_size = config, tp_rank, tp_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                   tp_rank, tp_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp_rank, tp_size)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: Linear | None = None
        if lm_head:
            self.lm_head = ColumnParallelLinear(config.hidden_size, [config.vocab_size],
                                                tp_size=tp_size)  # [V/tp, H]
        if lm_head and config.tie_word_embeddings:
            # a tied head is the embedding matrix itself: one tensor, not a copy
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(config, max_model_len or config.max_position_embeddings)

    @property
    def is_tied(self) -> bool:
        return self.lm_head is not None and self.lm_head.weight is self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [N] -> final hidden states [N, H]."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [M, H] -> float32 logits [M, V]; call it only on the positions that get sampled.

        With tp_size > 1 each rank computes its slice of the vocabulary [M, V/tp] and rank 0 gathers
        the slices (the other ranks get None: only rank 0 samples).
        """
        logits = self.lm_head(hidden)
        if self.tp_size > 1:
            logits = gather(logits, dim=-1)
        return logits.float() if logits is not None else None

    @property
    def num_kv_heads(self) -> int:
        """Key/value heads on this rank (what its KV cache holds)."""
        return self.config.num_key_value_heads // self.tp_size
