"""The fast paths compute the same function as the documented references they sit beside."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nanoqwen.attention.backends.sdpa import attention_sdpa, decode_attention, prefill_attention_blocked
from nanoqwen.attention.kv_cache import KVCache
from nanoqwen.models.qwen3 import attention_reference, rms_norm


def repeat_kv_attention(q, k, v, mask):
    """Textbook attention with K/V repeated per query head (what transformers' eager path does)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_reference_attention_is_grouped_query_attention(groups):
    g = torch.Generator().manual_seed(groups)
    q = torch.randn(2, 2 * groups, 5, 16, generator=g)
    k, v = torch.randn(2, 2, 7, 16, generator=g), torch.randn(2, 2, 7, 16, generator=g)
    mask = torch.rand(2, 1, 5, 7, generator=g) > 0.3
    mask[..., 0] = True
    torch.testing.assert_close(attention_reference(q, k, v, mask),
                               repeat_kv_attention(q, k, v, mask))


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_sdpa_prefill_equals_reference(groups):
    g = torch.Generator().manual_seed(10 + groups)
    q = torch.randn(1, 2 * groups, 9, 32, generator=g)
    k, v = torch.randn(1, 2, 9, 32, generator=g), torch.randn(1, 2, 9, 32, generator=g)
    causal = torch.ones(9, 9, dtype=torch.bool).tril()[None, None]
    torch.testing.assert_close(attention_sdpa(q, k, v, None, causal=True),
                               attention_reference(q, k, v, causal), atol=1e-5, rtol=1e-5)
    # a chunk of 4 queries after 5 cached keys
    chunk_mask = torch.arange(9)[None, :] <= torch.arange(5, 9)[:, None]
    qc = q[:, :, 5:]
    torch.testing.assert_close(attention_sdpa(qc, k, v, chunk_mask[None, None]),
                               attention_reference(qc, k, v, chunk_mask[None, None]), atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("num_cached", [0, 5])
def test_blocked_prefill_attention_equals_reference(groups, num_cached):
    """Query blocks of 4 over 10 new tokens: a partial last block, and keys cached before the
    chunk."""
    g = torch.Generator().manual_seed(30 + groups + num_cached)
    t, s = 10, 10 + num_cached
    q = torch.randn(2 * groups, t, 32, generator=g)
    k, v = torch.randn(2, s, 32, generator=g), torch.randn(2, s, 32, generator=g)
    causal = (torch.arange(s)[None, :] <= torch.arange(num_cached, s)[:, None])[None, None]
    expected = attention_reference(q[None], k[None], v[None], causal)[0]
    torch.testing.assert_close(prefill_attention_blocked(q, k, v, num_cached, block=4), expected,
                               atol=1e-5, rtol=1e-5)
    # bfloat16 (the path the engine takes on CPU): within bf16 rounding of the float32 answer
    got = prefill_attention_blocked(q.bfloat16(), k.bfloat16(), v.bfloat16(), num_cached, block=4)
    torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_folded_decode_attention_equals_reference(groups):
    g = torch.Generator().manual_seed(20 + groups)
    b, hkv, s, d = 3, 2, 11, 32
    q = torch.randn(b, hkv * groups, d, generator=g)
    k, v = torch.randn(b, hkv, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g)
    lens = torch.tensor([11, 4, 7])
    mask = (torch.arange(s)[None, :] < lens[:, None])[:, None, None, :]
    expected = attention_reference(q.unsqueeze(2), k, v, mask).squeeze(2)
    torch.testing.assert_close(decode_attention(q, k, v, mask), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(decode_attention(q, k, v, None),
                               attention_reference(q.unsqueeze(2), k, v, None).squeeze(2),
                               atol=1e-5, rtol=1e-5)


def test_decode_attention_takes_a_non_contiguous_kernel_output(monkeypatch):
    """On CUDA, float32 SDPA returns its [B, Hkv, G, D] output laid out as [B, G, Hkv, D] (seen on an H200:
    a .view of it failed); decode_attention must give the same answer from such a layout."""
    import nanoqwen.attention.backends.sdpa as attention

    sdpa = F.scaled_dot_product_attention

    def strided_sdpa(*args, **kwargs):
        out = sdpa(*args, **kwargs)  # [B, Hkv, G, D]
        return out.transpose(1, 2).contiguous().transpose(1, 2)  # same values, CUDA's layout

    g = torch.Generator().manual_seed(5)
    q = torch.randn(3, 8, 16, generator=g)
    k, v = torch.randn(3, 2, 9, 16, generator=g), torch.randn(3, 2, 9, 16, generator=g)
    expected = decode_attention(q, k, v, None)
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", strided_sdpa)
    assert not strided_sdpa(q.view(3, 2, 4, 16), k, v).is_contiguous()
    torch.testing.assert_close(decode_attention(q, k, v, None), expected, atol=0, rtol=0)


def test_rms_norm_is_computed_in_float32():
    x = (torch.randn(4, 64) * 30).to(torch.bfloat16)
    w = torch.rand(64).to(torch.bfloat16)
    x32 = x.float()
    expected = w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert torch.equal(rms_norm(x, w, 1e-6), expected)


def test_kv_cache_starts_as_zeros_and_copies_blocks_in_every_layer():
    cache = KVCache(2, 3, 16, 2, 8, torch.bfloat16, torch.device("cpu"))
    assert cache.k.abs().sum() == 0 and cache.v.abs().sum() == 0
    cache.k[:, 1] = torch.randn(2, 16, 2, 8).to(torch.bfloat16)
    cache.v[:, 1] = 2.0
    cache.copy_block(1, 2)
    assert torch.equal(cache.k[:, 2], cache.k[:, 1]) and (cache.v[:, 2] == 2.0).all()
    assert cache.k[:, 0].abs().sum() == 0
