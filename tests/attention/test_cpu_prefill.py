"""Prompt attention on CPU in bf16 with nanoqwen's kernels on (attention/backends/cpu_prefill.py): torch's products
around nanoqwen's causal_softmax_, against prefill_attention_blocked (the function it computes) and
attention_reference (the definition), and attend() choosing it where the engine's matmul path says so."""

from __future__ import annotations

import pytest
import torch

from nanoqwen.attention import attend as attend_module
from nanoqwen.attention.backends import cpu_prefill
from nanoqwen.attention.backends.cpu_prefill import prefill_attention_bf16
from nanoqwen.attention.backends.sdpa import prefill_attention_blocked
from nanoqwen.attention.metadata import PrefillChunk
from nanoqwen.models.qwen3 import attention_reference
from nanoqwen.ops.cpu import kernels as cpu_kernels
from nanoqwen.ops.cpu.matmul import TORCH_MATMUL, MatmulPath


@pytest.fixture
def kernels():
    if not cpu_kernels.available():
        pytest.skip(f"CPU kernels not available here ({cpu_kernels._failure or 'NANOQWEN_CPU_GEMV=0'})")
    return cpu_kernels


def future_keys(rows: int, keys: int, block: int) -> torch.Tensor:
    """[rows, keys] bool: row r (query r % block) sees the keys up to keys - block + r % block."""
    return torch.arange(keys)[None, :] > (keys - block + torch.arange(rows) % block)[:, None]


def masked_softmax(scores: torch.Tensor, block: int) -> torch.Tensor:
    """What causal_softmax_ computes, as prefill_attention_blocked computes it: torch.softmax of the bf16 scores
    with each query's later keys masked, rounded to bf16."""
    future = future_keys(scores.shape[-2], scores.shape[-1], block)
    return torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)


# keys not a multiple of the 8-lane vectors, one block or several, a block of 1 (decode-like) and the block as
# long as the keys (nothing cached before)
@pytest.mark.parametrize("rows, block, keys", [(12, 4, 37), (2 * 64, 64, 300), (8, 1, 9), (6, 6, 6), (32, 16, 1000)])
def test_causal_softmax_is_the_masked_softmax(kernels, rows, block, keys):
    g = torch.Generator().manual_seed(rows + keys)
    scores = (torch.randn(3, rows, keys, generator=g) * 4).bfloat16()
    want = masked_softmax(scores, block)
    got = kernels.causal_softmax_(scores.clone(), block)
    assert got.dtype == torch.bfloat16
    # a query's later keys get exactly 0, its own key never; every row sums to 1 within its roundings
    future = future_keys(rows, keys, block).expand_as(got)
    assert (got[future] == 0).all()
    last_visible = (keys - block + torch.arange(rows) % block)[None, :, None].expand(3, rows, 1)
    assert (got.gather(-1, last_visible) > 0).all()
    torch.testing.assert_close(got.float().sum(-1), torch.ones(3, rows), atol=0.02, rtol=0)
    # the same values: e^x through another polynomial than torch's, rounded to bf16 afterwards
    torch.testing.assert_close(got, want, atol=1e-3, rtol=0.008)
    assert (got == want).float().mean().item() > 0.99


def test_causal_softmax_wrong_inputs_raise(kernels):
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.causal_softmax_(torch.zeros(4, 8), 4)
    with pytest.raises(RuntimeError, match="whole blocks of 3"):
        kernels.causal_softmax_(torch.zeros(4, 8, dtype=torch.bfloat16), 3)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.causal_softmax_(torch.zeros(8, 4, dtype=torch.bfloat16).t(), 4)


# q heads, kv heads, D, prompt tokens, cached tokens, query block: a partial last block, GQA groups of 1 and 2,
# keys cached before the chunk, Qwen3's head shape
@pytest.mark.parametrize("hq, hkv, d, t, num_cached, block", [(4, 2, 32, 50, 0, 16), (4, 2, 32, 50, 37, 16),
                                                              (3, 3, 16, 9, 0, 4), (16, 8, 128, 300, 200, 128)])
@pytest.mark.parametrize("heads_together", [True, False])  # (a long context's scores take one kv head at a time)
def test_prefill_attention_bf16_is_the_blocked_function(kernels, monkeypatch, hq, hkv, d, t, num_cached, block,
                                                        heads_together):
    if not heads_together:
        monkeypatch.setattr(cpu_prefill, "SCORES_BYTES", 0)
    g = torch.Generator().manual_seed(t + num_cached)
    q = torch.randn(hq, t, d, generator=g).bfloat16()
    k = torch.randn(hkv, num_cached + t, d, generator=g).bfloat16()
    v = torch.randn(hkv, num_cached + t, d, generator=g).bfloat16()
    got = prefill_attention_bf16(q, k, v, num_cached, block)
    want = prefill_attention_blocked(q, k, v, num_cached, block)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=0.01, rtol=0.016)
    assert (got == want).float().mean().item() > 0.98
    pos = torch.arange(num_cached, num_cached + t)[:, None]
    mask = (torch.arange(num_cached + t)[None, :] <= pos)[None, None]
    ref = attention_reference(q.float()[None], k.float()[None], v.float()[None], mask)[0]
    torch.testing.assert_close(got.float(), ref, atol=0.03, rtol=0.02)
    # k and v as the paged cache hands them (views of a [S, Hkv, D] layout): the same bits
    k_view, v_view = k.transpose(0, 1).contiguous().transpose(0, 1), v.transpose(0, 1).contiguous().transpose(0, 1)
    assert torch.equal(prefill_attention_bf16(q, k_view, v_view, num_cached, block), got)


def test_attend_takes_it_where_the_kernels_are_on(kernels, monkeypatch):
    """The bf16 path with nanoqwen's kernels on runs prefill_attention_bf16; torch's matmuls (the reference path)
    and bf16 with the kernels off run prefill_attention_blocked."""
    calls = []
    monkeypatch.setattr(attend_module, "prefill_attention_bf16",
                        lambda *args: calls.append("bf16") or prefill_attention_bf16(*args))
    monkeypatch.setattr(attend_module, "prefill_attention_blocked",
                        lambda *args, **kw: calls.append("blocked") or prefill_attention_blocked(*args, **kw))
    g = torch.Generator().manual_seed(0)
    t, num_cached = 20, 5
    q = torch.randn(t, 4, 32, generator=g).bfloat16()
    k, v = (torch.randn(1, 2, num_cached + t, 32, generator=g).bfloat16() for _ in range(2))
    chunk = PrefillChunk(block_table=[0], query_start=0, query_len=t, context_len=num_cached + t)
    outs = {}
    for name, path in [("kernels", MatmulPath(path="bf16", gemv_max_rows=8)), ("torch", TORCH_MATMUL)]:
        outs[name] = attend_module.prefill_attention(q, k, v, chunk, path)
    assert calls == ["bf16", "blocked"]
    torch.testing.assert_close(outs["kernels"], outs["torch"], atol=0.01, rtol=0.016)
    assert not MatmulPath(path="bf16", gemv_max_rows=8).own_prompt_softmax(q.half())
    assert not MatmulPath(path="float32", gemv_max_rows=8).own_prompt_softmax(q)
