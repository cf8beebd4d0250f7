"""Paged decode attention as a Triton kernel: each sequence's keys and values are read from their
cache blocks in place, never gathered into a dense copy.

One program per (sequence, kv head) handles the G = Hq / Hkv query heads that share that kv head. It
walks the sequence's context BLOCK_N tokens at a time, finding each token's cache block through the
block table, and keeps an online softmax (running max, running sum of exponentials, weighted sum of
values) in float32. The G query heads are padded to 16 rows so both products run as `tl.dot` (the
tensor cores' smallest tile); the padding rows are zeros and never stored. A row with context_len 0
(a CUDA-graph padding row) runs no iteration and stores zeros. Float32 caches use exact (IEEE)
products rather than tf32. A quantized cache (int8 or float8 codes with a float32 scale per token and kv
head, nanoqwen/attention/kv_cache.py) is read as codes * scale, rounded to the query's dtype for the products.

Run on CPU tensors with TRITON_INTERPRET=1 set before this module is imported
(tests/attention/test_paged_attention.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr, scale, k_scale_ptr, v_scale_ptr,
    stride_qb, stride_qh,  # q [B, Hq, D]; D contiguous
    stride_ob, stride_oh,  # out [B, Hq, D]; D contiguous
    stride_kb, stride_ks, stride_kh,  # k_cache [num_blocks, block_size, Hkv, D]; D contiguous
    stride_vb, stride_vs, stride_vh,  # v_cache likewise
    stride_tb,  # block_tables [B, max_blocks]
    stride_sb, stride_ss,  # k_scale, v_scale [num_blocks, block_size, Hkv] (QUANTIZED only); Hkv contiguous
    QUANTIZED: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    context_len = tl.load(lens_ptr + seq)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    g_ok, d_ok = g < GROUP, d < HEAD_DIM
    heads = kv_head * GROUP + g  # the query heads of this kv head
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # [GROUP_PAD, DIM_PAD]
    row_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    row_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for start in range(0, context_len, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] token positions
        # at least pos == start is in range, so every row of s has a finite max
        ok = pos < context_len
        block = tl.load(tables_ptr + seq * stride_tb + pos // BLOCK_SIZE,
                        mask=ok, other=0).to(tl.int64)
        offset = pos % BLOCK_SIZE
        kv_mask = ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + block[:, None] * stride_kb + offset[:, None] * stride_ks
                    + kv_head * stride_kh + d[None, :],
                    mask=kv_mask, other=0.0)  # [BLOCK_N, DIM_PAD]
        v = tl.load(v_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vs
                    + kv_head * stride_vh + d[None, :],
                    mask=kv_mask, other=0.0)
        if QUANTIZED:  # codes * their token's scale, in the query's dtype
            scale_at = block * stride_sb + offset * stride_ss + kv_head
            ks = tl.load(k_scale_ptr + scale_at, mask=ok, other=0.0)  # [BLOCK_N]
            vs = tl.load(v_scale_ptr + scale_at, mask=ok, other=0.0)
            k = (k.to(tl.float32) * ks[:, None]).to(q.dtype)
            v = (v.to(tl.float32) * vs[:, None]).to(q.dtype)
        if IEEE:  # float32 caches: exact products, not tf32
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(ok[None, :], s * scale, float("-inf"))  # [GROUP_PAD, BLOCK_N]
        new_max = tl.maximum(row_max, tl.max(s, axis=1))
        # rescales what was summed under the old max (0 on the first iteration)
        alpha = tl.exp(row_max - new_max)
        p = tl.exp(s - new_max[:, None])
        row_sum = row_sum * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        row_max = new_max
    # context_len 0: acc is 0, so the row is zeros
    out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
    tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


def paged_decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, context_lens: torch.Tensor,
                                  scale: float, out: torch.Tensor | None = None,
                                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                                  block_n: int = 64) -> torch.Tensor:
    """q [B, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D] (for a quantized cache: codes, with
    k_scale, v_scale [num_blocks, block_size, Hkv]); block_tables [B, max_blocks] int32; context_lens [B] int32
    -> [B, Hq, D] (written into out when given)."""
    b, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    if out is None:
        out = torch.empty_like(q)
    for name, t in (("q", q), ("out", out), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension")
    group = hq // hkv
    quantized = k_scale is not None
    if not quantized:  # (never read)
        k_scale = v_scale = context_lens
    elif not (k_scale.is_contiguous() and v_scale.is_contiguous()):
        raise ValueError("k_scale and v_scale must be contiguous")
    _paged_decode_kernel[(b, hkv)](
        q, k_cache, v_cache, out, block_tables, context_lens, scale, k_scale, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        k_scale.stride(0) if quantized else 0, k_scale.stride(1) if quantized else 0, QUANTIZED=quantized,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=d,
        DIM_PAD=max(16, triton.next_power_of_2(d)), BLOCK_SIZE=block_size, BLOCK_N=block_n,
        IEEE=q.dtype == torch.float32,
    )
    return out
