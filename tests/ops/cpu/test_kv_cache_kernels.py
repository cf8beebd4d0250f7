"""nanoqwen's CPU decode kernels over a quantized KV cache (kv_cache_dtype int8, fp8_e4m3, fp8_e5m2: codes and
float32 scales, nanoqwen/attention/kv_cache.py), read and written in place.

- attention_inputs writes each head's codes and scale as quantize_kv makes them from the bf16 keys and values the
  bf16 path writes, to the bit;
- paged_decode_attention computes paged_decode_attention_reference over the dequantized cache (dequantize_kv, float32)
  up to float32 rounding: within one bf16 rounding of the output;
- decode_model and decode_steps carry each layer's scales: a fused decode step over a quantized cache gives the
  logits of the same step done kernel by kernel with the cache quantized by quantize_kv and attention computed by
  the reference on the dequantized cache (close logits, equal greedy tokens).
"""

from __future__ import annotations

import pytest
import torch

from nanoqwen.attention.backends.paged import paged_decode_attention_reference
from nanoqwen.attention.kv_cache import KV_QUANTIZATIONS, KVCache, dequantize_kv, quantize_kv
from nanoqwen.ops.cpu import kernels as cpu_kernels

QUANTIZED = list(KV_QUANTIZATIONS)  # "int8", "fp8_e4m3", "fp8_e5m2"


@pytest.fixture(scope="module")
def kernels():
    if not cpu_kernels.available():
        pytest.skip(f"CPU kernels not available here ({cpu_kernels._failure or 'NANOQWEN_CPU_GEMV=0'})")
    return cpu_kernels


def bf16_ulp(y: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |y| (8 significant bits): 2^(exponent - 7); the smallest normal's below."""
    y = y.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    return torch.exp2(torch.floor(torch.log2(y)) - 7)


def assert_within_bf16_rounding(got: torch.Tensor, want: torch.Tensor, magnitude: float) -> None:
    """got == want (both bf16, each the float32 result rounded once) within one bf16 ulp of either, plus float32
    noise relative to `magnitude` (the largest value the weighted sums add up)."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    diff = (got.float() - want.float()).abs()
    allowed = torch.maximum(bf16_ulp(want), bf16_ulp(got)) + 1e-5 * magnitude
    assert (diff <= allowed).all(), f"beyond one bf16 ulp by {(diff - allowed).max().item()}"


def wide_range(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Random bf16 values over several orders of magnitude, so that float8 codes include subnormals and the largest
    codes (+-qmax) as well as normals."""
    return (torch.randn(shape, generator=g) * torch.exp(2 * torch.randn(shape, generator=g))).bfloat16()


@pytest.mark.parametrize("cache_dtype", QUANTIZED)
def test_attention_inputs_store_quantize_kv_codes_and_scales(kernels, cache_dtype):
    """attention_inputs over a quantized cache: q as over a bf16 cache, and at each slot the codes and scales of
    quantize_kv of the bf16 keys (after QK-norm and RoPE) and values the bf16 path stores, equal to the bit (torch's
    float32 division, int8 round-half-even, float8 conversion); other slots untouched. Head widths with and without
    a scalar tail, GQA, scattered slots, a zero value vector (scale 0, zero codes), one built to round at ties and one
    of subnormals (whose codes need the clamp to +-qmax)."""
    quant = KV_QUANTIZATIONS[cache_dtype]
    g = torch.Generator().manual_seed(11)
    for hq, hkv, d in ((16, 8, 128), (6, 3, 20), (4, 1, 24)):
        m, blocks, block_size = 3, 5, 4
        qkv = wide_range((m, (hq + 2 * hkv) * d), g)
        v_part = qkv[:, (hq + hkv) * d:].view(m, hkv, d)
        v_part[1, 0] = 0  # a zero vector
        ties = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 100.25, 6.5])  # (int8: scale 1, codes at ties)
        v_part[2, -1] = ties.repeat(d // 8 + 1)[:d].bfloat16()
        # bf16 subnormals: the scale is a float32 subnormal of few bits, x / scale passes qmax (e5m2: 65536, clamped)
        v_part[0, -1] = (torch.tensor([1.0, -1, 2, 3, -3, 0, 1, 2]).repeat(d // 8 + 1)[:d] * 2.0**-133).bfloat16()
        q_norm, k_norm = (1 + torch.randn(2, d, generator=g) / 4).bfloat16()
        cos, sin = torch.randn(2, m, d, generator=g).bfloat16()
        slots = torch.tensor([17, 2, 9])
        k_bf16, v_bf16 = torch.zeros(2, blocks, block_size, hkv, d, dtype=torch.bfloat16)
        want_q = kernels.attention_inputs(qkv, q_norm, k_norm, 1e-6, hq, cos, sin, k_bf16, v_bf16, slots)
        k_codes, v_codes = torch.randint(-100, 100, (2, blocks, block_size, hkv, d), generator=g, dtype=torch.int8)
        k_codes, v_codes = k_codes.view(quant.dtype), v_codes.view(quant.dtype)  # (nonzero before: overwritten)
        k_scale, v_scale = torch.rand(2, blocks, block_size, hkv, generator=g)
        before = [t.clone() for t in (k_codes, v_codes, k_scale, v_scale)]
        q = kernels.attention_inputs(qkv, q_norm, k_norm, 1e-6, hq, cos, sin, k_codes, v_codes, slots,
                                     k_scale=k_scale, v_scale=v_scale)
        assert torch.equal(q, want_q)
        for codes, scale, values, old_codes, old_scale in ((k_codes, k_scale, k_bf16, *before[0::2]),
                                                           (v_codes, v_scale, v_bf16, *before[1::2])):
            want_codes, want_scale = quantize_kv(values.view(-1, hkv, d)[slots], quant)
            got_codes, got_scale = codes.view(-1, hkv, d)[slots], scale.view(-1, hkv)[slots]
            assert got_codes.dtype == quant.dtype
            assert torch.equal(got_codes.view(torch.int8), want_codes.view(torch.int8)), cache_dtype
            assert torch.equal(got_scale, want_scale)
            others = torch.ones(blocks * block_size, dtype=torch.bool)
            others[slots] = False
            assert torch.equal(codes.view(-1, hkv, d)[others].view(torch.int8),
                               old_codes.view(-1, hkv, d)[others].view(torch.int8))
            assert torch.equal(scale.view(-1, hkv)[others], old_scale.view(-1, hkv)[others])
        assert v_scale.view(-1, hkv)[2, 0] == 0 and not v_codes.view(-1, hkv, d)[2, 0].view(torch.int8).any()
        if cache_dtype == "int8" and d % 8 == 0:  # (exact ties: 2.5 -> 2, -3.5 -> -4, 0.5 -> 0, 1.5 -> 2, 6.5 -> 6)
            assert v_codes.view(-1, hkv, d)[9, -1, :8].tolist() == [127, 2, -4, 0, 0, 2, 100, 6]


@pytest.mark.parametrize("cache_dtype", QUANTIZED)
def test_paged_decode_attention_reads_the_codes_in_place(kernels, cache_dtype):
    """paged_decode_attention over a quantized cache is the reference's attention over the dequantized cache, within
    one bf16 rounding: rows of 1, 37, 300 and 1100 positions (one span, one span shared by the threads, several
    spans) and an empty row (zeros), on shuffled blocks, for GQA 2 (Qwen3-0.6B's heads), one kv head for four query
    heads, no GQA, and a head width with a scalar tail."""
    quant = KV_QUANTIZATIONS[cache_dtype]
    g = torch.Generator().manual_seed(12)
    lens = torch.tensor([1, 37, 300, 0, 1100], dtype=torch.int32)
    for hq, hkv, d, block_size in ((16, 8, 128, 16), (4, 1, 64, 16), (4, 4, 32, 8), (6, 3, 20, 16)):
        width = -(-int(lens.max()) // block_size)
        num_blocks = width * len(lens)
        tables = torch.randperm(num_blocks, generator=g).view(len(lens), width).int()  # (no two rows share a block)
        k_codes, k_scale = quantize_kv(wide_range((num_blocks, block_size, hkv, d), g), quant)
        v_codes, v_scale = quantize_kv(wide_range((num_blocks, block_size, hkv, d), g), quant)
        k_scale[tables[4, 3], 5] = 0  # keys of scale 0 (scores 0)
        q = torch.randn(len(lens), hq, d, generator=g).bfloat16()
        got = kernels.paged_decode_attention(q, k_codes, v_codes, tables, lens, d**-0.5, k_scale=k_scale,
                                             v_scale=v_scale)
        k, v = dequantize_kv(k_codes, k_scale), dequantize_kv(v_codes, v_scale)  # float32
        want = paged_decode_attention_reference(q, k, v, tables, lens, d**-0.5)
        assert_within_bf16_rounding(got, want, v.abs().max().item())
        assert torch.equal(got[3], torch.zeros_like(got[3]))
        out = torch.empty_like(q)
        assert kernels.paged_decode_attention(q, k_codes, v_codes, tables, lens, d**-0.5, out=out,
                                              k_scale=k_scale, v_scale=v_scale) is out
        assert torch.equal(out, got)


@pytest.mark.parametrize("cache_dtype", QUANTIZED)
def test_codes_widen_exactly_at_every_code(kernels, cache_dtype):
    """Every code of the dtype (float8: each finite value, subnormals and +-qmax included; int8: -128 .. 127), read
    as the value vector of a context of one position with scale 1: the output is each code's value (exact in bf16).
    A widening wrong for some codes (e4m3's subnormals, its factor 256) fails here."""
    quant = KV_QUANTIZATIONS[cache_dtype]
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.int8)
    codes = bits.view(quant.dtype)
    if quant.dtype != torch.int8:
        codes = codes[codes.float().isfinite()]
    d = 8 * -(-codes.numel() // 8)
    values = torch.zeros(1, 2, 1, d, dtype=quant.dtype)  # one block of two positions, one kv head
    values[0, 0, 0, : codes.numel()] = codes
    keys = torch.zeros(1, 2, 1, d, dtype=quant.dtype)
    scale_k, scale_v = torch.ones(2, 1, 2, 1)
    q = torch.zeros(1, 1, d, dtype=torch.bfloat16)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    got = kernels.paged_decode_attention(q, keys, values, tables, lens, 1.0, k_scale=scale_k, v_scale=scale_v)
    assert torch.equal(got[0, 0, : codes.numel()], codes.float().bfloat16())
    assert not got[0, 0, codes.numel():].any()


def test_quantized_cache_arguments_are_checked(kernels):
    """Each malformed cache or scale is refused with a message naming it: a cache dtype the kernels do not read,
    codes without scales, scales with a bf16 cache, k and v of different dtypes, scales of the wrong shape or dtype."""
    hq, hkv, d = 4, 2, 16
    q = torch.randn(1, hq, d).bfloat16()
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    codes = torch.zeros(2, 4, hkv, d, dtype=torch.int8)
    scale = torch.ones(2, 4, hkv)

    def attend(k, v, k_scale=None, v_scale=None):
        return kernels.paged_decode_attention(q, k, v, tables, lens, 0.25, k_scale=k_scale, v_scale=v_scale)

    half = codes.half()
    with pytest.raises(RuntimeError, match="k_cache must be bfloat16, or a quantized cache's int8, float8_e4m3fn or "
                                           "float8_e5m2 codes"):
        attend(half, half)
    with pytest.raises(RuntimeError, match="got float16"):
        attend(half, half)
    with pytest.raises(RuntimeError, match="needs its scales k_scale and v_scale"):
        attend(codes, codes)
    with pytest.raises(RuntimeError, match="needs its scales"):
        attend(codes, codes, k_scale=scale)
    with pytest.raises(RuntimeError, match="a bfloat16 cache has none"):
        attend(codes.bfloat16(), codes.bfloat16(), scale, scale)
    with pytest.raises(RuntimeError, match="v_cache must be int8 as k_cache is, got float8_e4m3fn"):
        attend(codes, codes.view(torch.float8_e4m3fn), scale, scale)
    with pytest.raises(RuntimeError, match=r"v_scale must be \[2, 4, 2\]"):
        attend(codes, codes, scale, scale[:, :, :1])
    with pytest.raises(RuntimeError, match="k_scale must be a CPU float32 tensor, got bfloat16"):
        attend(codes, codes, scale.bfloat16(), scale)
    with pytest.raises(RuntimeError, match="v_scale must be contiguous"):
        attend(codes, codes, scale, scale.transpose(0, 1).contiguous().transpose(0, 1))
    qkv = torch.randn(1, (hq + 2 * hkv) * d).bfloat16()
    norm, rope = torch.ones(d, dtype=torch.bfloat16), torch.ones(1, d, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="needs its scales"):
        kernels.attention_inputs(qkv, norm, norm, 1e-6, hq, rope, rope, codes, codes, torch.tensor([0]))
    with pytest.raises(RuntimeError, match="k_cache must be bfloat16, or a quantized"):
        kernels.attention_inputs(qkv, norm, norm, 1e-6, hq, rope, rope, half, half, torch.tensor([0]))
    assert attend(codes, codes, scale, scale).shape == q.shape  # (the well-formed call runs)


# ---- a decode step in one call (decode_model, decode_steps) over a quantized cache

H, HQ, HKV, D, INTER, VOCAB, LAYERS = 64, 4, 2, 32, 96, 80, 2
BLOCK_SIZE, MAX_POS = 4, 64


def random_weights(seed: int) -> dict:
    """A random two-layer model's bf16 weights (one dict a layer, and the embedding, final norm and LM head)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, mean: float = 0.0) -> torch.Tensor:
        return (mean + torch.randn(*shape, generator=g) / 4).bfloat16()

    layers = [dict(input_norm=rand(H, mean=1), post_norm=rand(H, mean=1), qkv=rand((HQ + 2 * HKV) * D, H),
                   q_norm=rand(D, mean=1), k_norm=rand(D, mean=1), o=rand(H, HQ * D), gate_up=rand(2 * INTER, H),
                   down=rand(H, INTER)) for _ in range(LAYERS)]
    angles = torch.arange(MAX_POS)[:, None] / 10000 ** (torch.arange(D) % (D // 2) / (D // 2))[None, :]
    return dict(layers=layers, embed=rand(VOCAB, H) * 4, norm=rand(H, mean=1), lm_head=rand(VOCAB, H),
                cos=angles.cos(), sin=angles.sin())


def fused_weights(kernels, w: dict) -> object:
    bf16 = lambda w: [("bf16", [w])]  # noqa: E731 (a linear of one bf16 matrix)
    layers = [kernels.decoder_layer_weights(
        input_norm=x["input_norm"], post_norm=x["post_norm"], eps=1e-6, qkv_proj=bf16(x["qkv"]), q_norm=x["q_norm"],
        k_norm=x["k_norm"], o_proj=bf16(x["o"]), gate_up_proj=bf16(x["gate_up"]), down_proj=bf16(x["down"]),
        num_heads=HQ)
        for x in w["layers"]]
    return kernels.decoder_model_weights(embed=("bf16", [w["embed"]]), cos=w["cos"], sin=w["sin"], layers=layers,
                                         norm=w["norm"], eps=1e-6, lm_head=[("bf16", [w["lm_head"]])])


def store(cache: KVCache, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """KVCache.store's writes for a quantized cache: quantize_kv's codes and scales at the slots (the codes copied as
    bytes: torch's CPU index_copy_ has no float8 kernel)."""
    for pool, scales, x in ((cache.k, cache.k_scale, k), (cache.v, cache.v_scale, v)):
        codes, scale = quantize_kv(x, cache.quantization)
        pool[layer].view(torch.int8).view(-1, HKV, D).index_copy_(0, slots, codes.view(torch.int8))
        scales[layer].view(-1, HKV).index_copy_(0, slots, scale)


def reference_step(kernels, w: dict, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                   slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """decode_model's step kernel by kernel in Python, the quantized cache written as KVCache.store writes it
    (quantize_kv) and attention by paged_decode_attention_reference over the cache dequantized in float32 -> float32
    logits."""
    cos, sin = w["cos"][positions].bfloat16(), w["sin"][positions].bfloat16()
    x = w["embed"][ids]
    for i, lw in enumerate(w["layers"]):
        h = kernels.rms_norm(x, lw["input_norm"], 1e-6)
        qkv = kernels.bf16_gemv(h, lw["qkv"])
        q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=1)
        q = kernels.apply_rope(kernels.rms_norm(q.reshape(-1, HQ, D), lw["q_norm"], 1e-6), cos, sin)
        k = kernels.apply_rope(kernels.rms_norm(k.reshape(-1, HKV, D), lw["k_norm"], 1e-6), cos, sin)
        store(cache, i, k, v.reshape(-1, HKV, D), slots)
        k_codes, v_codes, k_scale, v_scale = cache.layer(i)
        attn = paged_decode_attention_reference(q, dequantize_kv(k_codes, k_scale), dequantize_kv(v_codes, v_scale),
                                                tables, lens, D**-0.5)
        x, h = kernels.add_rms_norm(x, kernels.bf16_gemv(attn.reshape(-1, HQ * D), lw["o"]), lw["post_norm"], 1e-6)
        mlp = kernels.bf16_gemv(kernels.swiglu(kernels.bf16_gemv(h, lw["gate_up"])), lw["down"])
        x = x + mlp
    return kernels.bf16_gemv(kernels.rms_norm(x, w["norm"], 1e-6), w["lm_head"]).float()


@pytest.mark.parametrize("cache_dtype", QUANTIZED)
def test_decode_model_over_a_quantized_cache(kernels, cache_dtype):
    """Two sequences decoded token by token (22 steps, block tables interleaved) through decode_model with a
    quantized KVCache's codes and scales, beside the same steps kernel by kernel (reference_step): the caches hold
    the same codes, scales and logits agree within bf16 noise, and each step's greedy token is the same. Then
    decode_steps continues both for 6 steps in one call over a copy of the cache: the tokens decode_model gives step
    by step."""
    w = random_weights(21)
    model = fused_weights(kernels, w)
    blocks = 2 * -(-(22 + 6) // BLOCK_SIZE)
    fused, reference = (KVCache(LAYERS, blocks, BLOCK_SIZE, HKV, D, torch.bfloat16, torch.device("cpu"),
                                cache_dtype=cache_dtype) for _ in range(2))
    tables = torch.arange(blocks, dtype=torch.int32).view(-1, 2).T.contiguous()  # (0, 2, 4, ...) and (1, 3, 5, ...)
    ids, prompt_ids = torch.tensor([3, 7]), torch.tensor([[3, 7], [11, 2], [5, 5], [60, 1]])
    for step in range(22):
        if step < len(prompt_ids):  # (the first steps feed given tokens, as a prompt would)
            ids = prompt_ids[step]
        positions = torch.full((2,), step)
        slots = tables[:, step // BLOCK_SIZE].long() * BLOCK_SIZE + step % BLOCK_SIZE
        lens = torch.full((2,), step + 1, dtype=torch.int32)
        got = kernels.decode_model(model, ids, positions, fused.k, fused.v, slots, tables, lens,
                                   k_scales=fused.k_scale, v_scales=fused.v_scale)
        want = reference_step(kernels, w, ids, positions, reference, slots, tables, lens)
        # layer 0's keys and values are the same bits on both paths (its input is the embedding's rows), so the
        # same codes and scales; later layers' inputs differ by the attention's float32 rounding
        for mine, theirs in zip(fused.layer(0), reference.layer(0), strict=True):
            assert torch.equal(mine.view(torch.int8), theirs.view(torch.int8)), step
        torch.testing.assert_close(got, want, atol=0.05 * want.abs().max().item(), rtol=0.0, msg=f"step {step}")
        assert torch.equal(got.argmax(-1), want.argmax(-1)), step
        ids = want.argmax(-1)
    copy = KVCache(LAYERS, blocks, BLOCK_SIZE, HKV, D, torch.bfloat16, torch.device("cpu"), cache_dtype=cache_dtype)
    for name in ("k", "v", "k_scale", "v_scale"):
        getattr(copy, name).copy_(getattr(fused, name))
    lens = torch.full((2,), 23, dtype=torch.int32)
    tokens = kernels.decode_steps(model, ids, copy.k, copy.v, tables, lens, torch.full((2, 1), -1), 6,
                                  k_scales=copy.k_scale, v_scales=copy.v_scale)
    expected = []
    for step in range(22, 28):
        slots = tables[:, step // BLOCK_SIZE].long() * BLOCK_SIZE + step % BLOCK_SIZE
        logits = kernels.decode_model(model, ids, torch.full((2,), step), fused.k, fused.v, slots, tables,
                                      torch.full((2,), step + 1, dtype=torch.int32), k_scales=fused.k_scale,
                                      v_scales=fused.v_scale)
        ids = logits.argmax(-1)
        expected.append(ids.tolist())
    assert tokens.tolist() == expected
    assert torch.equal(copy.k.view(torch.int8), fused.k.view(torch.int8))
    assert torch.equal(copy.v_scale, fused.v_scale)


def test_decode_model_refuses_scales_for_another_number_of_layers(kernels):
    """k_scales and v_scales are one layer's each per cache layer: scales of one layer for a two-layer cache are
    refused, naming them; a quantized cache without scales too."""
    w = random_weights(22)
    model = fused_weights(kernels, w)
    cache = KVCache(LAYERS, 2, BLOCK_SIZE, HKV, D, torch.bfloat16, torch.device("cpu"), cache_dtype="int8")
    step = (torch.tensor([5]), torch.tensor([[1, 0]], dtype=torch.int32), torch.tensor([6], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"k_scales and v_scales must be \[2, blocks, block_size, Hkv\]"):
        kernels.decode_model(model, torch.tensor([3]), torch.tensor([5]), cache.k, cache.v, *step,
                             k_scales=cache.k_scale[:1], v_scales=cache.v_scale[:1])
    with pytest.raises(RuntimeError, match="needs its scales"):
        kernels.decode_model(model, torch.tensor([3]), torch.tensor([5]), cache.k, cache.v, *step)
    logits = kernels.decode_model(model, torch.tensor([3]), torch.tensor([5]), cache.k, cache.v, *step,
                                  k_scales=cache.k_scale, v_scales=cache.v_scale)
    assert logits.shape == (1, VOCAB) and cache.k_scale[:, 1, 1].gt(0).all()  # (slot 5: each layer's key stored)
