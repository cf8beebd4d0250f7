"""nanoqwen's CPU kernels. For decode steps: matrix-vector products (bf16, int8 and int4 weights times a few rows
of bf16 activations), and the rest of a decode step in few calls (RMSNorm, RoPE, SwiGLU for few rows; attention
reading the paged KV cache in place). For prompts on CPUs without fast bf16 arithmetic: a GEMM and prompt
attention (below).

Decoding one token (or a handful of sequences) multiplies each weight matrix by 1..8 activation rows. Each
weight is then used only a few times, so the product is bound by how fast the weights stream from memory, and
a good kernel reads them at close to the machine's read bandwidth. On CPUs without native bf16 instructions
(AVX2-only: AMD Zen, most Intel client chips) torch's bf16 `F.linear` and its weight-only int8 kernel
(`torch.ops.aten._weight_int8pack_mm`) are far from that: they are built for many rows, and for one row they
spend their time converting and reshuffling rather than reading.

The kernels in csrc/ (gemv.cpp, int4_gemv.cpp, int4_gemm.cpp, decode_ops.cpp, kv_cache_ops.cpp; module.cpp binds them;
cpu_kernels.h says what each holds) do the simple thing, as llama.cpp and vLLM do for this case: each weight row is
read once, widened to float32 in AVX2 registers, multiplied with all rows of x with FMA into several float32
accumulators, and each output is rounded to bf16 once. Threads split the output rows. `bf16_gemv` computes
exactly what `bf16_gemv_reference` below computes, up to the order of float32 additions
(tests/ops/cpu/test_kernels.py checks this; bench/bench_gemv.py measures the speed). The integer kernels do less
work per weight, as llama.cpp does for quantised weights: x is quantised once per call, in blocks, and each
block's products are integer dot products scaled in float32 once per block. `int8_gemv` rounds x to int16 in
blocks of INT8_X_BLOCK (64) elements (an error of at most 2^-16 of the block's largest value) and multiplies
16 weights widened to int16 in one instruction (AVX2 vpmaddwd, AVX-512 VNNI's vpdpwssd); `int4_gemv` rounds x to int8
in blocks of the weights' group size (64) and multiplies with maddubs (AVX2) or vpdpbusd (VNNI). Each
computes its reference (`int8_gemv_reference`, `int4_gemv_reference`: x quantised the same way) up to the
order of float32 additions. Widening each weight to float32 for an FMA instead keeps them compute-bound,
under the read bandwidth.

For more than 8 rows (a prompt, a large batch) `int4_gemv` computes the same function as a small GEMM,
`int4_gemm`: the weights are unpacked 16 rows at a time into a panel laid out for the integer dot product
(each vector lane an output column), and every row of x runs over the panel in register tiles of 4 rows. The
integer products run at twice the rate of bf16 ones (VNNI) or float32 FMAs (AVX2 maddubs), so a 4-bit
prompt runs faster than the bf16 model's (bench/bench_model.py measures both), with the same numerics as a
4-bit decode step.

On CPUs whose bf16 matrix products are slow (ops/cpu/matmul.py's float32 path), products over many rows compute in
float32. `bf16_gemm` (and `int8_gemm`) do that as BLIS and OpenBLAS structure a GEMM (csrc/gemm.cpp): x packed
once, the weights converted to float32 while they are packed into cache-sized panels, a 6 x 16 register-tiled FMA
kernel; the same function as upcast_linear (convert blocks, then torch's float32 product), faster where
ops/cpu/matmul.py measured it so. `prefill_attention` runs a prompt chunk's attention through the same kernel in
one call, rounding where attention/attend.py's prefill_attention_blocked rounds. On the bf16 path, `causal_softmax_`
is that function's masked softmax in one pass, between torch's two products (attention/backends/cpu_prefill.py).

The extension is compiled on first use (ops/cpu/build.py: torch.utils.cpp_extension, a C++ compiler needed;
the build cached under a name that hashes the source and flags, so an edit rebuilds).
The decode-step kernels (`rms_norm`, `apply_rope`, `swiglu`, `paged_decode_attention`, and for `decode_model`
`attention_inputs`, QK-norm, RoPE and the KV store in one pass, and `add_rms_norm`, a residual add and the norm
after it) exist because a
decode step's elementwise work is small: in plain torch each RMSNorm or RoPE is 5-9 ops, each a dispatch and
an allocation costing microseconds, and attention gathers each sequence's blocks into a new tensor first;
per step that is more time than the matmuls' of a 4-bit model (bench/bench_decode_step.py measures it). Each
computes what its reference in models/qwen3.py or attention/backends/paged.py computes, rounding where it rounds
(tests/ops/cpu/test_kernels.py).

`attention_inputs` and `paged_decode_attention` (so `decode_model` and `decode_steps`) also take a quantized KV
cache (kv_cache_dtype int8, fp8_e4m3, fp8_e5m2: attention/kv_cache.py's codes and float32 scales, one a token and
kv head) in place: the new keys and values are stored as quantize_kv stores them, to the bit, and attention widens
each code to float32 as it reads it (int8 and e5m2 exactly; e4m3 through float16 bits, its value / 256, the 256
folded into the scale), a score's key scale applied after its dot product and a value's scale folded into its
softmax weight (tests/ops/cpu/test_kv_cache_kernels.py). Half the bytes of a bf16 cache to read, the same
arithmetic on them.

`available()` says whether the kernels can be used: False where NANOQWEN_CPU_GEMV=0 (read until the kernels
are loaded), where the CPU lacks AVX2/FMA, or where the build fails (one warning with the reason, then False
for the rest of the process).

Inputs: x bf16 [..., K] (any leading shape, M = their product; bf16 and int8: groups of 16 rows re-read the
weights, so those kernels are meant for M <= 16), weights bf16 / int8 [N, K], bias / scale bf16 [N], all on
the CPU; int4: packed uint8 [N, K/2], scale and offset bf16 [N, K/G] (the format of nanoqwen/quantization/int4.py:
rows stored lane by lane in blocks of 16).
Non-contiguous inputs are copied to contiguous ones first (correct, but a copied weight costs an extra pass);
other dtypes, devices or shapes raise RuntimeError with a message naming the argument.
"""

from __future__ import annotations

import logging
import os
import threading
from functools import partial
from types import ModuleType

import torch
import torch.nn.functional as F

from nanoqwen.ops.cpu import build as cpu_build
from nanoqwen.ops.hf_quants import dequantize_fp8
from nanoqwen.ops.quantize import dequantize_int4, dequantize_int8_group

logger = logging.getLogger("nanoqwen")
ENV = "NANOQWEN_CPU_GEMV"  # "0" disables the kernels (no build)

_lock = threading.Lock()
_ext: ModuleType | None = None  # the built extension, once available() succeeded
_failure: str | None = None  # why it is not available, once that is known (warned about once)


def bf16_gemv_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What bf16_gemv computes: x @ w.T + bias in float32, rounded to bf16 once."""
    return F.linear(x.float(), w.float(), None if bias is None else bias.float()).to(torch.bfloat16)


INT8_X_BLOCK = 64  # elements of x per int16 scale in int8_gemv (csrc/gemv.cpp's kXBlock)


def int8_linear_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(x @ q.T) * scale in float32, rounded to x's dtype once: an int8 linear (int8_gemm computes this)."""
    return (F.linear(x.float(), q.float()) * scale.float()).to(x.dtype)


def int8_gemv_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What int8_gemv computes: int8_linear_reference of bf16 x quantised to int16 in blocks of INT8_X_BLOCK
    (quantize_activations), rounded to bf16 once."""
    x_read = quantize_activations(x, INT8_X_BLOCK, levels=32767)  # float32: rounded to bf16 below, once
    return int8_linear_reference(x_read, q, scale).to(torch.bfloat16)


def quantize_activations(x: torch.Tensor, block: int, levels: int = 127) -> torch.Tensor:
    """x rounded as int4_gemv (int8: levels 127) and int8_gemv (int16: levels 32767) read it: in blocks of
    `block` consecutive elements of each row (the last one shorter where `block` does not divide K), one
    float32 scale d = max|x| / levels per block (xq = round(x / d), half to even), returned as d * xq in
    float32 [..., K]."""
    k = x.shape[-1]
    xb = F.pad(x.float(), (0, -k % block)).unflatten(-1, (-1, block))  # [..., ceil(K / block), block]
    d = xb.abs().amax(-1, keepdim=True) / levels
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return ((xb * inverse).round() * d).flatten(-2)[..., :k]


def fp8_gemv_reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What fp8_gemv computes: bf16 x times the FP8 weights dequantised (ops/hf_quants.py dequantize_fp8) in
    float32, rounded to bf16 once."""
    return (x.float() @ dequantize_fp8(w, scale).T).to(torch.bfloat16)


def int8_group_gemv_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                              super_scale: torch.Tensor | None = None, super_offset: torch.Tensor | None = None
                              ) -> torch.Tensor:
    """What int8_group_gemv computes: x quantised to int16 per group of the weights' G (quantize_activations),
    times the weights dequantised (ops/quantize.py's dequantize_int8_group) in float32, rounded to bf16 once."""
    w = dequantize_int8_group(q, scale, offset, super_scale, super_offset)  # [N, K] (q int8, or packed at 5/6 bits)
    x_read = quantize_activations(x, w.shape[1] // scale.shape[1], levels=32767)
    return (x_read @ w.T).to(torch.bfloat16)


def int4_gemv_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                        *supers: torch.Tensor) -> torch.Tensor:
    """What int4_gemv computes: x' @ W.T in float32, rounded to bf16 once, where W = offset + scale * q
    (quantization/int4.py; supers: two-level scales' super_scale, super_offset) and x' is x quantised to int8 in
    blocks of the group size G (quantize_activations)."""
    group = 2 * packed.shape[-1] // scale.shape[-1]
    x_rounded = quantize_activations(x, group)
    return F.linear(x_rounded, dequantize_int4(packed, scale, offset, *supers)).to(torch.bfloat16)


def bf16_gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ w.T + bias for bf16 x [..., K], w [N, K], bias [N]; y bf16 [..., N]. Needs available()."""
    if _ext is None:
        _require()
    if x.dim() == 2:  # the common case, kept free of Python-side tensor ops (each costs microseconds)
        return _ext.bf16_gemv(x, w, bias)
    return _ext.bf16_gemv(x.reshape(-1, x.shape[-1]), w, bias).view(*x.shape[:-1], w.shape[0])


def bf16_gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y = x @ w.T for bf16 or float32 x [..., K] and bf16 w [N, K], computed in float32 and rounded to x's dtype
    once (bf16_gemv_reference's function, for many rows: prompts on CPUs without fast bf16 compute). Weights are
    converted to float32 in cache-sized panels inside the product (csrc/gemm.cpp), not in a copy beside it."""
    if _ext is None:
        _require()
    return _ext.bf16_gemm(x, w)


def int8_gemm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y = (x @ q.T) * scale for bf16 or float32 x [..., K], int8 q [N, K], bf16 scale [N], in float32, rounded to
    x's dtype once (int8_linear_reference's function, for many rows): bf16_gemm with int8 weights."""
    if _ext is None:
        _require()
    return _ext.int8_gemm(x, q, scale)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_cached: int, scale: float,
                      block: int) -> torch.Tensor:
    """attention/attend.py prefill_attention_blocked's function (float32 products, scores and probabilities
    rounded to bf16) for one prompt chunk: bf16 q [T, Hq, D] at positions num_cached .. num_cached + T - 1,
    k and v [num_cached + T, Hkv, D] (the paged cache's layout) -> [T, Hq, D]. One call: each kv head's query
    blocks run as two products of bf16_gemm's kernel around a softmax, the threads taking them in turn."""
    if _ext is None:
        _require()
    return _ext.prefill_attention(q, k, v, num_cached, scale, block)


def causal_softmax_(scores: torch.Tensor, block: int) -> torch.Tensor:
    """In place: bf16 scores [..., R, keys], R a multiple of block, row r the query at block position r % block
    whose last visible key is keys - block + r % block -> bf16(softmax) over each row's visible keys (float32
    inside), 0 after them: prefill_attention_blocked's masked_fill and softmax in one pass. Returns scores."""
    if _ext is None:
        _require()
    _ext.causal_softmax_(scores, block)
    return scores


def int8_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y = (x @ q.T) * scale for bf16 x [..., K], int8 q [N, K], bf16 scale [N]; y bf16 [..., N]."""
    if _ext is None:
        _require()
    if x.dim() == 2:
        return _ext.int8_gemv(x, q, scale)
    return _ext.int8_gemv(x.reshape(-1, x.shape[-1]), q, scale).view(*x.shape[:-1], q.shape[0])


def fp8_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y = x @ (w * scale).T for bf16 x [..., K] (few rows), float8_e4m3fn w [N, K] and float32 scale [N, K/B] (one
    per row and block of B inputs); y bf16 [..., N] (fp8_gemv_reference). Each weight widens to float32 as it is
    read."""
    if _ext is None:
        _require()
    y = _ext.fp8_gemv(x.reshape(-1, x.shape[-1]), w, scale)  # [M, N]
    return y.view(*x.shape[:-1], w.shape[0])


def int8_group_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                    super_scale: torch.Tensor | None = None, super_offset: torch.Tensor | None = None) -> torch.Tensor:
    """y = x' @ (q * scale + offset).T for bf16 x [..., K] (few rows), int8 q [N, K] (or uint8: values packed at 6
    bits [N, 3K/4] or 5 bits [N, 5K/8], ops/quantize.py pack_int6 / pack_int5), scale and offset [N, K/G] (G 16 or
    32; offset None: none, or for 5-bit values the symmetric -16 scale) float32 or float16, or two levels: int8 or
    uint8 ones with float32 super_scale / super_offset [N, K/(SG)] (a group's value their product); y bf16 [..., N]
    (int8_group_gemv_reference)."""
    if _ext is None:
        _require()
    y = _ext.int8_group_gemv(x.reshape(-1, x.shape[-1]), q, scale, offset, super_scale, super_offset)  # [M, N]
    return y.view(*x.shape[:-1], q.shape[0])


def int8_group_dequantize(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
                          super_scale: torch.Tensor | None, super_offset: torch.Tensor | None,
                          in_features: int) -> torch.Tensor:
    """ops/quantize.py dequantize_int8_group's float32 [N, in_features] matrix, bit for bit, in one pass (the 5- and
    6-bit values unpacked as int8_group_gemv reads them): the prompt path's weights."""
    if _ext is None:
        _require()
    return _ext.int8_group_dequantize(q, scale, offset, super_scale, super_offset, in_features)


def int4_gemv(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
              *supers: torch.Tensor, amx_min_rows: int = 0) -> torch.Tensor:
    """y = x' @ W.T for bf16 x [..., K] and int4 W (packed [N, K/2], scale and offset [N, K/G]: bf16, float16 or
    float32 (offset None: symmetric, -8 scale), or uint8 with supers = (super_scale, super_offset) float32
    [N, K/(8G)]: two levels); y bf16 [..., N].
    x' is x quantised to int8 in blocks of W's group size (int4_gemv_reference): the dot products are integer
    ones. Any number of rows: up to 8 stream the weights (decode), more go through int4_gemm's panels
    (prefill); from amx_min_rows rows on (0: never) int4_amx's tiles, where amx_int8_available()."""
    if _ext is None:
        _require()
    if amx_min_rows <= 0:
        return _int4(_ext.int4_gemv, x, packed, scale, offset, *supers)
    # (the extension checks the tiles are there; the selection sets amx_min_rows only where amx_int8_available())
    return _int4(partial(_ext.int4_gemv, amx_min_rows=amx_min_rows), x, packed, scale, offset, *supers)


def int4_amx(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
             *supers: torch.Tensor) -> torch.Tensor:
    """int4_gemm's product on AMX tiles (csrc/amx.cpp: a group of 16 rows of x times 16 weight rows is one tdpbsud),
    whatever the row count: the same bits as int4_gemm. Needs amx_int8_available() and a group size of at most 64
    or a multiple of 64."""
    if not amx_int8_available():
        raise RuntimeError("int4_amx needs AMX-INT8 tiles: this CPU has none, Linux did not grant them, or "
                           "ATEN_CPU_CAPABILITY limits it to AVX2")
    return _int4(_ext.int4_amx, x, packed, scale, offset, *supers)


def set_int4_amx_min_rows(rows: int) -> None:
    """From how many rows decode_model's int4 products run on AMX tiles (0: never; the tiles compute the same bits,
    so only the speed changes): the process's choice, set by ops/cpu/selection.py. Nothing to set (and no
    decode_model to run) where the kernels are not loaded."""
    if _ext is not None:
        _ext.set_int4_amx_min_rows(rows)


def bf16_amx(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y = x @ w.T for bf16 x [M, K] and w [N, K] (K a multiple of 32, N of 16) on AMX-BF16 tiles, in float32, rounded
    to bf16 once: bf16_gemv_reference's function for many rows (needs amx_bf16_available()). The weights are read as
    stored, 16 rows of 32 values a tile; x is packed once into the tiles' pair layout (csrc/amx.cpp)."""
    if _ext is None:
        _require()
    return _ext.bf16_amx(x, w)


def int8_amx(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y = (x @ q.T) * scale for bf16 x [..., K], int8 q [N, K] (K a multiple of 32, N of 16) and a bf16 scale per row,
    on AMX-BF16 tiles, in float32, rounded to bf16 once: int8_linear_reference's function for many rows (needs
    amx_bf16_available()). Each block of 16 weight rows is widened to bf16 (exact) a depth step at a time, x packed
    once as for bf16_amx (csrc/amx.cpp)."""
    if _ext is None:
        _require()
    if x.dim() == 2:
        return _ext.int8_amx(x, q, scale)
    return _ext.int8_amx(x.reshape(-1, x.shape[-1]), q, scale).view(*x.shape[:-1], q.shape[0])


def amx_bf16_available() -> bool:
    """Whether bf16_amx can run: as amx_int8_available, for AMX-BF16 tiles."""
    return (available() and _ext is not None and not cpu_build.limited_to_avx2()
            and bool(_ext.amx_bf16_ready()))


def amx_int8_available() -> bool:
    """Whether int4_amx can run: the kernels available(), this CPU with AMX-INT8 tiles and AVX-512BW, Linux granting
    the process the tiles' state (asked once), and the process not limited to AVX2 (ATEN_CPU_CAPABILITY=avx2)."""
    return (available() and _ext is not None and not cpu_build.limited_to_avx2()
            and bool(_ext.amx_int8_ready()))


def int4_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
              *supers: torch.Tensor) -> torch.Tensor:
    """int4_gemv's product computed on unpacked panels of W (a small GEMM, as int4_gemv computes more than 8
    rows) whatever the row count: the same function, up to the order of float32 additions."""
    if _ext is None:
        _require()
    return _int4(_ext.int4_gemm, x, packed, scale, offset, *supers)


def _int4(kernel, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
          *supers: torch.Tensor) -> torch.Tensor:
    """kernel(x, packed, scale, offset, *supers) for x [..., K]: leading dims flattened to rows and restored."""
    if x.dim() == 2:
        return kernel(x, packed, scale, offset, *supers)
    return kernel(x.reshape(-1, x.shape[-1]), packed, scale, offset, *supers).view(*x.shape[:-1], packed.shape[0])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """models.qwen3.rms_norm for bf16 x [..., D] (one call; rounds where the reference rounds)."""
    if _ext is None:
        _require()
    return _ext.rms_norm(x, weight, eps)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, rms_norm(h)) with h = x + y, for bf16 x, y [M, D] in one call: a residual add and the norm after it, the
    same bits as torch's bf16 add and rms_norm (decode_model's step between layers)."""
    if _ext is None:
        _require()
    return _ext.add_rms_norm(x, y, weight, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """models.qwen3.apply_rope for bf16 x [N, H, D], cos/sin [N, D]."""
    if _ext is None:
        _require()
    return _ext.apply_rope(x, cos, sin)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """models.qwen3.swiglu for bf16 gate_up [N, 2I] -> [N, I]."""
    if _ext is None:
        _require()
    return _ext.swiglu(gate_up)


def argmax(values: torch.Tensor) -> torch.Tensor:
    """torch.argmax(values, dim=-1) for float32 or bf16 values [B, V] (V > 0) -> int64 [B]: the first of tied maxima,
    a NaN as the largest."""
    if _ext is None:
        _require()
    return _ext.argmax(values)


def top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs float32 [B, V] (>= 0), top_p [B] -> float32 [B]: sample.sampler.top_p_threshold_reference's values,
    by a radix select over each row's bits instead of a sort."""
    if _ext is None:
        _require()
    return _ext.top_p_threshold(probs, top_p)


def exponential_race(probs: torch.Tensor, token_ids: torch.Tensor | None, keys: torch.Tensor) -> torch.Tensor:
    """probs float32 [B, K] (>= 0), token_ids int64 [B, K] (None: each column's own index), keys int64 [B] ->
    int64 [B]: sample.sampler.exponential_race_reference's choice, without a [B, K] noise tensor."""
    if _ext is None:
        _require()
    return _ext.exponential_race(probs, token_ids, keys)


def loaded() -> bool:
    """Whether the kernels are built and loaded in this process (False before the first available(): never builds)."""
    return _ext is not None


def attention_inputs(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, eps: float, num_heads: int,
                     cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """decode_model's step between qkv_proj and attention, for bf16 qkv [M, (Hq + 2 Hkv) D]: q and k through
    rms_norm (per head) and apply_rope, k and v stored at slot_mapping in k_cache, v_cache [blocks, block_size,
    Hkv, D] -> q [M, Hq, D]; the same bits as those kernels and index_copy_. A quantized cache (int8 or float8
    codes, KVCache's k, v for a kv_cache_dtype) with its float32 scales k_scale, v_scale [blocks, block_size, Hkv]
    gets each head's bf16 k (those bits) and v as attention/kv_cache.py's quantize_kv makes them, to the bit."""
    if _ext is None:
        _require()
    return _ext.attention_inputs(qkv, q_norm, k_norm, eps, num_heads, cos, sin, k_cache, v_cache, slot_mapping,
                                 k_scale, v_scale)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """attention/backends/paged.py's paged_decode_attention_reference for bf16 on CPU, reading the cache
    blocks in place: threads take spans of up to 256 positions of a sequence (shorter, down to 32, while a
    sequence has fewer spans than threads), all heads at once (a position's heads lie side by side in the
    cache), and each sequence's spans are combined as flash decoding combines them.

    A quantized cache (int8, float8_e4m3fn or float8_e5m2 codes with float32 scales k_scale, v_scale [blocks,
    block_size, Hkv]: attention/kv_cache.py) is read in place too, each code widened as it is used: the
    reference's function over the dequantized cache (dequantize_kv), up to float32 rounding, from half the bytes.
    Another cache dtype, or scales missing or given with a bf16 cache, raises RuntimeError naming them."""
    if _ext is None:
        _require()
    result = _ext.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale)
    return result if out is None else out.copy_(result)


def decoder_layer_weights(**weights: object) -> object:
    """A decoder layer's weights gathered for decode_model (worker/fused_decoder.py names them): a C++ object that
    holds the tensors (no copy)."""
    _require()
    return _ext.DecoderLayerWeights(**weights)


def decoder_model_weights(**weights: object) -> object:
    """A model's weights gathered for decode_model (worker/fused_decoder.py names them; `layers`: decoder_layer_weights
    each): a C++ object that holds the tensors (no copy)."""
    _require()
    return _ext.DecoderModelWeights(**weights)


def decoder_layer_lora(**weights: list[torch.Tensor]) -> object:
    """A decoder layer's LoRA adapters gathered for decode_model: for each of qkv_proj, o_proj, gate_up_proj and
    down_proj, [] (none) or [a [R, in], b [out, R]] bf16, the scaling in b, adding (x @ a.T) @ b.T to the linear's
    output. A C++ object that holds the tensors (no copy)."""
    _require()
    return _ext.DecoderLayerLoRA(**weights)


def decoder_lora_weights(layers: list[object]) -> object:
    """One LoRA adapter over a model gathered for decode_model and decode_steps (`lora`): a decoder_layer_lora a
    layer. A C++ object that holds the tensors (no copy)."""
    _require()
    return _ext.DecoderLoRAWeights(layers)


def decode_model(model: object, input_ids: torch.Tensor, positions: torch.Tensor, k_caches: torch.Tensor,
                 v_caches: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, lora: object | None = None, k_scales: torch.Tensor | None = None,
                 v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """A decode step's forward (decoder_model_weights), one C++ call: input_ids [M] at positions [M] -> float32
    logits [M, V]; layer i uses the caches k_caches[i], v_caches[i]. lora: one adapter for every row
    (decoder_lora_weights), or None. k_scales, v_scales [layers, blocks, block_size, Hkv]: a quantized cache's
    scales (KVCache.k_scale, v_scale; None for a bf16 cache)."""
    if _ext is None:
        _require()
    return _ext.decode_model(model, input_ids, positions, k_caches, v_caches, slot_mapping, block_tables,
                             context_lens, lora, k_scales, v_scales)


def decode_steps(model: object, input_ids: torch.Tensor, k_caches: torch.Tensor, v_caches: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, stop_token_ids: torch.Tensor,
                 num_steps: int, lora: object | None = None, k_scales: torch.Tensor | None = None,
                 v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Up to num_steps greedy decode steps (decoder_model_weights), one C++ call: step s feeds each row's token from
    step s - 1 at position context_lens - 1 + s (context_lens [M] int32: step 0's) and takes its logits' argmax;
    stops early once every row has produced one of its stop_token_ids [M, S] (int64, -1 pads). block_tables [M, W]
    must cover the last step's position. lora, k_scales, v_scales: as decode_model's. -> the tokens [steps run, M]
    int64."""
    if _ext is None:
        _require()
    return _ext.decode_steps(model, input_ids, k_caches, v_caches, block_tables, context_lens, stop_token_ids,
                             num_steps, lora, k_scales, v_scales)


def _require() -> None:
    if not available():
        reason = f"{ENV}=0" if os.environ.get(ENV, "1") == "0" else _failure
        raise RuntimeError(f"nanoqwen's CPU gemv kernels are not available ({reason})")


def available() -> bool:
    """Whether the kernels can run here; builds them on the first call (seconds to a minute, then cached)."""
    global _ext, _failure
    if _ext is not None:
        return True
    if os.environ.get(ENV, "1") == "0":
        return False
    if _failure is not None:
        return False
    with _lock:
        if _ext is None and _failure is None:
            try:
                _ext = cpu_build.build()
            except Exception as e:  # no compiler, no AVX2, a compile error: stay correct on torch's kernels
                first_line = (str(e).strip().splitlines() or [""])[0][:300]
                _failure = f"{type(e).__name__}: {first_line}"
                logger.warning("nanoqwen's CPU gemv kernels are not available (%s); using torch's matmuls", _failure)
    return _ext is not None


def int4_dot_instructions() -> str:
    """How int4_gemv multiplies (for the log line and `nanoqwen bench`): "AVX-512 VNNI" or "AVX2"."""
    return "AVX-512 VNNI" if available() and _ext.has_vnni() else "AVX2"


def bf16_dot_instructions() -> str:
    """How bf16_gemv multiplies (for the log line and `nanoqwen bench`): AVX-512 BF16's bf16 dot products, or
    AVX2 FMAs on weights widened to float32."""
    return "AVX-512 BF16 dot products" if available() and _ext.has_bf16_dot() else "AVX2 FMA"
