"""Weight-only int4 (nanoqwen/quantization/int4.py): the format of one matrix, both ways of computing
with it (nanoqwen's kernel for few rows, unpacked weights otherwise) and the fallback without the
kernels, quality against the unquantised model, wiring."""

from __future__ import annotations

import pytest
import torch
from conftest import run_cli
from test_int8 import (
    BENCH_CHECKPOINT,
    compare,
    linear_of,
    load,
    random_experts,
    random_tokens,
    random_weight,
)

from nanoqwen import LLM, SamplingParams
from nanoqwen.errors import ConfigError
from nanoqwen.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from nanoqwen.models.qwen3 import experts_reference
from nanoqwen.ops.cpu import kernels as cpu_kernels
from nanoqwen.ops.cpu.kernels import quantize_activations
from nanoqwen.ops.cpu.matmul import MatmulPath
from nanoqwen.ops.quantize import dequantize_int4, int4_group_size, int4_lanes_to_rows, quantize_int4
from nanoqwen.quantization import Int4Experts, Int4Linear, quantize_model, weight_bytes
from nanoqwen.quantization import base as quantization_base
from nanoqwen.quantization.int4 import int4_dequantized_linear


def without_kernels(monkeypatch) -> None:
    """As on a machine where nanoqwen's C++ kernels cannot be built."""
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)


@pytest.fixture
def no_kernels(monkeypatch):
    without_kernels(monkeypatch)


# ---------------------------------------------------------------- (a) one matrix


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_error_is_at_most_half_a_step_per_group(dtype):
    w = random_weight(96, 128, dtype)  # a zero row, an outlier, a tiny row
    packed, stored_scale, stored_offset = quantize_int4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (96, 64)
    assert stored_scale.dtype == stored_offset.dtype == dtype
    assert stored_scale.shape == stored_offset.shape == (96, 2)
    err = (w.double() - dequantize_int4(packed, stored_scale, stored_offset).double()).abs().view(96, 2, 64)
    # row o's scales and offsets (stored lane by lane: the next test)
    scale, offset = int4_lanes_to_rows(stored_scale, 1), int4_lanes_to_rows(stored_offset, 1)
    # half a step, plus the offset's own rounding to the stored dtype (half an ulp of the minimum)
    lo = w.double().view(96, 2, 64).amin(-1)
    allowed = scale.double() / 2 + (lo - offset.double()).abs() + 1e-12
    assert (err <= allowed[..., None] * (1 + 1e-6)).all()
    # 15 steps span each group: the scale is (max - min) / 15 rounded up, by at most one step of the
    # dtype (a subnormal's spacing for float16's tiny rows)
    span = w.double().view(96, 2, 64).amax(-1) - lo
    nonconstant = span > 0
    exact, info = span[nonconstant] / 15, torch.finfo(dtype)
    assert (scale.double()[nonconstant] >= exact * (1 - 2**-23)).all()
    step = torch.clamp(exact * 2 * info.eps, min=info.smallest_normal * info.eps)
    assert (scale.double()[nonconstant] <= exact + step).all()
    assert (dequantize_int4(packed, stored_scale, stored_offset)[1] == 0).all() and (scale[1] == 1).all()


def test_two_weights_per_byte_element_j_low_and_j_plus_half_high():
    # one group of 32 whose weights are their own indices: q = index, offset 0, scale 1 ... 31 / 15
    # (one row: a block of one lane, so the row's bytes in order)
    w = torch.cat([torch.arange(16.0), torch.arange(16.0)]).view(1, 32)
    packed, scale, offset = quantize_int4(w, 32)
    assert offset.item() == 0 and scale.item() == 1
    assert packed[0].tolist() == [j | (j << 4) for j in range(16)]
    w[0, 16:] = 15 - w[0, 16:]  # high nibbles reversed
    packed, _, _ = quantize_int4(w, 32)
    assert packed[0].tolist() == [j | ((15 - j) << 4) for j in range(16)]


def test_rows_are_stored_lane_by_lane_in_blocks_of_16():
    # 40 rows (two blocks of 16 and one of 8), two groups of 32: row r's q is (j + r) % 16 at element
    # j of a group (0 and 15 in every group: offset 0), its scale (r % 8 + 1) / 8 (exact in bfloat16)
    rows, groups, g = 40, 2, 32
    q = (torch.arange(groups * g) % g + torch.arange(rows)[:, None]) % 16  # [rows, 64]
    row_scale = (torch.arange(rows) % 8 + 1) / 8
    w = (q * row_scale[:, None]).bfloat16()
    packed, scale, offset = quantize_int4(w, g)
    assert (offset == 0).all()
    row_bytes = (q[:, :16] | q[:, 16:32] << 4, q[:, 32:48] | q[:, 48:] << 4)  # each group's 16 bytes
    flat_packed, flat_scale = packed.reshape(-1), scale.reshape(-1)
    for r in range(rows):
        n0, lane = r // 16 * 16, r % 16
        lanes = min(16, rows - n0)  # the last block holds 8
        for group in range(groups):
            assert flat_scale[n0 * groups + group * lanes + lane] == row_scale[r]
            for c in range(4):  # 4 bytes at a time: chunk c of the group, lane by lane
                at = n0 * 32 + ((group * 4 + c) * lanes + lane) * 4
                assert flat_packed[at:at + 4].tolist() == row_bytes[group][r, 4 * c:4 * c + 4].tolist()
    assert torch.equal(dequantize_int4(packed, scale, offset), w.float())
    # whole blocks dequantise on their own (int4_dequantized_linear takes rows in blocks of 16)
    assert torch.equal(dequantize_int4(packed[16:], scale[16:], offset[16:]), w[16:].float())
    assert torch.equal(dequantize_int4(packed[:16], scale[:16], offset[:16]), w[:16].float())


def test_group_size_is_64_or_the_largest_of_32_and_16_that_fits():
    assert [int4_group_size(n) for n in (1024, 3072, 96, 48, 16)] == [64, 64, 32, 16, 16]
    with pytest.raises(ConfigError, match=r"layers\.0\.mlp\.down_proj has 40.*int8"):
        int4_group_size(40, "layers.0.mlp.down_proj")


def int4_layer(out_features: int, in_features: int, dtype: torch.dtype, bias: bool) -> Int4Linear:
    linear = Linear(in_features, out_features, bias=bias).to(dtype)
    linear.weight.data = random_weight(out_features, in_features, dtype)
    if bias:
        linear.bias.data = torch.randn(out_features, generator=torch.Generator().manual_seed(1)
                                       ).to(dtype)
    return Int4Linear.from_linear(linear)


@pytest.mark.parametrize("kernels", [True, False], ids=["own-kernels", "no-compiler"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 77])
@pytest.mark.parametrize("bias", [False, True])
def test_int4_linear_is_the_float32_product_with_its_weights(kernels, dtype, rows, bias,
                                                             monkeypatch):
    """Whatever path it takes (the C++ kernel for bf16 rows: streaming up to 8, panels above; unpacking
    for float32; plain torch without a compiler), an Int4Linear computes x @ W4.T in float32 and
    rounds once (the bias added after, in the model dtype, as Linear adds it), on a CPU whose matmuls
    run in float32 (the AVX2 path; the native-bf16 one is the next test). The kernel reads x quantised
    to int8 in blocks of the group size (its integer dot products): x' @ W4.T there."""
    if not kernels:
        without_kernels(monkeypatch)
    monkeypatch.setattr(quantization_base, "UPCAST_BLOCK_BYTES", 4 * 128 * 50)  # 200 rows in 50-row blocks
    layer = int4_layer(200, 128, dtype, bias)
    layer.matmul_path = MatmulPath("float32", "test")
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).to(dtype)
    w4 = dequantize_int4(layer.weight, layer.scale, layer.offset)
    kernel_path = kernels and dtype == torch.bfloat16
    x_read = quantize_activations(x, int4_group_size(128)) if kernel_path else x.float()
    product = (x_read @ w4.T).to(dtype)
    expected = product if layer.bias is None else product + layer.bias
    out = layer(x)
    assert out.dtype == dtype and out.shape == (rows, 200)
    # the kernel adds in another order: one rounding step of the product apart at most, and one of
    # the sum with the bias (which may cancel most of the product), and mostly equal
    step = 2**-7 * (product.float().abs() + expected.float().abs()) + 1e-5
    assert ((out.float() - expected.float()).abs() <= step).all()
    if dtype == torch.float32:  # the unpacked path; BLAS may add in another order (for some outputs
        # where MKL is limited to AVX2), so close, not equal
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    elif not kernels:  # the unpacked path, rounded to bf16: exactly that
        assert torch.equal(out, expected)
    else:  # rounded to bf16 after another order of additions: mostly the same bits
        assert (out == expected).float().mean() > 0.9
    assert torch.equal(layer(x.view(1, rows, 128)), out.view(1, rows, 200))


@pytest.mark.parametrize("kernels", [True, False], ids=["int4_gemm", "no-compiler"])
def test_int4_prefill_on_a_native_bf16_cpu(kernels, monkeypatch):
    """Where bf16 matmuls are fast too, many bf16 rows take the int4 kernel's panels, which compute what a
    decode step computes (one function for every row count: a request's tokens do not depend on its batch);
    without the kernels, W4 unpacked and rounded to bf16 for torch's bf16 matmul."""
    if not kernels:
        without_kernels(monkeypatch)
    layer = int4_layer(200, 128, torch.bfloat16, bias=False)
    layer.matmul_path = MatmulPath("bf16", "test")
    x = torch.randn(77, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    unpacked = torch.nn.functional.linear(x, dequantize_int4(layer.weight, layer.scale, layer.offset).bfloat16())
    for rows in (1, 8, 63, 64, 77):
        got = layer(x[:rows])
        if kernels:
            want = cpu_kernels.int4_gemm(x[:rows], layer.weight, layer.scale, layer.offset)
            assert torch.equal(got, want) and torch.equal(got, layer(x)[:rows])  # the same bits in any batch
            assert not torch.equal(want, unpacked[:rows])
        else:
            assert torch.equal(got, unpacked[:rows])


def test_tensor_parallel_linears_keep_their_class(no_kernels):
    column = ColumnParallelLinear(64, [32, 32])
    row = RowParallelLinear(64, 32, tp_size=2)
    for linear in (column, row):
        linear.weight.data = random_weight(*linear.weight.shape, torch.float32)
    int4_column, int4_row = Int4Linear.from_linear(column), Int4Linear.from_linear(row)
    assert isinstance(int4_column, ColumnParallelLinear) and int4_column.output_sizes == [32, 32]
    assert isinstance(int4_row, RowParallelLinear) and int4_row.tp_size == 2
    assert int4_row.in_features == 32 and int4_row.out_features == 32


def test_int4_experts_compute_each_expert_as_its_int4_linear():
    experts = random_experts(torch.bfloat16)
    int4 = Int4Experts(experts)
    assert {n: (b.dtype, b.shape) for n, b in int4.named_buffers()} == {
        "gate_up_proj": (torch.uint8, (4, 96, 32)), "gate_up_proj_scale": (torch.bfloat16, (4, 96, 1)),
        "gate_up_proj_offset": (torch.bfloat16, (4, 96, 1)),
        "down_proj": (torch.uint8, (4, 64, 24)), "down_proj_scale": (torch.bfloat16, (4, 64, 3)),
        "down_proj_offset": (torch.bfloat16, (4, 64, 3))}
    g = torch.Generator().manual_seed(0)
    for name in ("gate_up_proj", "down_proj"):
        for e in range(4):
            reference = Int4Linear.from_linear(linear_of(getattr(experts, name)[e]))
            assert torch.equal(getattr(int4, name)[e], reference.weight)
            x = torch.randn(3, reference.in_features, generator=g).bfloat16()
            assert torch.equal(int4.expert_linear(x, name, e), reference(x))


def test_int4_experts_equal_the_reference_on_their_weights():
    int4 = Int4Experts(random_experts(torch.float32))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 64, generator=g)
    ids = torch.rand(40, 4, generator=g).argsort(dim=-1)[:, :2]
    weights = torch.rand(40, 2, generator=g)

    def dequantized(name: str) -> torch.Tensor:
        parts = [getattr(int4, name + suffix) for suffix in ("", "_scale", "_offset")]
        return torch.stack([dequantize_int4(*(p[e] for p in parts)) for e in range(4)])

    expected = experts_reference(x, dequantized("gate_up_proj"), dequantized("down_proj"), ids,
                                 weights)
    torch.testing.assert_close(int4(x, ids, weights), expected, atol=1e-5, rtol=1e-5)


def test_unpacking_in_blocks_equals_unpacking_at_once(monkeypatch, no_kernels):
    layer = int4_layer(333, 96, torch.bfloat16, False)
    x = torch.randn(20, 96).bfloat16()
    whole = int4_dequantized_linear(x, layer.weight, layer.scale, layer.offset)
    monkeypatch.setattr(quantization_base, "UPCAST_BLOCK_BYTES", 4 * 96 * 50)  # (float32 compute: no fast bf16)
    monkeypatch.setattr(quantization_base, "BF16_BLOCK_BYTES", 2 * 96 * 50)  # (bf16 compute)
    calls = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w: calls.append(w.shape[0]) or linear(x, w))
    assert torch.equal(int4_dequantized_linear(x, layer.weight, layer.scale, layer.offset), whole)
    assert calls == [48] * 6 + [45]  # whole blocks of 16 rows: 48 of each 50


# -------------------------------------------------------- (b) quality against the unquantised model

# (min top-1 agreement, max mean KL in nats) over 300 positions, bf16, std 0.08 weights (as for int8
# in test_quantization.py). The thresholds allow about twice the KL that int4 gives on these models
# (dense tied, dense untied, MoE); a 3-bit grid (8 levels) fails each of them and the 0.6B test below.
TINY_THRESHOLDS = {"gqa1-tied-headdim": (0.40, 0.03), "gqa2-untied": (0.30, 0.04)}
MOE_THRESHOLDS = (0.33, 0.03)


def agreement_and_kl(model, tokens: list[int]) -> tuple[float, float]:
    from conftest import prompt_logits

    ref = prompt_logits(model, tokens)
    quantize_model(model, "int4")
    return compare(ref, prompt_logits(model, tokens))


@pytest.mark.parametrize("name", list(TINY_THRESHOLDS))
def test_quality_on_a_tiny_random_model(checkpoint, name):
    agree, kl = agreement_and_kl(load(checkpoint(name, dtype="bfloat16", std=0.08)),
                                 random_tokens(300))
    min_agree, max_kl = TINY_THRESHOLDS[name]
    assert agree >= min_agree and kl <= max_kl, f"top-1 agreement {agree:.3f}, KL {kl:.5f}"


def test_quality_on_a_tiny_random_moe_model(moe_bf16_dir):
    agree, kl = agreement_and_kl(load(moe_bf16_dir), random_tokens(300))
    assert agree >= MOE_THRESHOLDS[0] and kl <= MOE_THRESHOLDS[1], (
        f"top-1 agreement {agree:.3f}, KL {kl:.5f}")


def test_quality_and_size_on_the_qwen3_0_6b_shape(qwen3_0_6b):
    """The bench checkpoint (random weights, std 0.02: near-tied argmaxes, see the int8 test), 256
    positions. Thresholds: agreement 0.15 (2 binomial standard deviations below what int4 gives), KL
    0.06. Weights 1.19 GB -> 0.65 GB: the tied
    embedding stays bf16 (0.31 GB) beside the int4 head."""
    model = load(qwen3_0_6b)
    bf16_bytes = weight_bytes(model)
    agree, kl = agreement_and_kl(model, random_tokens(256))
    assert agree >= 0.15 and kl <= 0.06, f"top-1 agreement {agree:.3f}, KL {kl:.5f}"
    assert 0.54 < weight_bytes(model) / bf16_bytes < 0.55


def test_quality_of_the_kernel_path_on_the_qwen3_0_6b_shape(qwen3_0_6b, monkeypatch):
    """Decode-sized calls (16-token prompts: 16 rows) take int4_gemv, whose activations are
    quantised to int8 in blocks of 64, on 16 x 16 positions: about as close to bf16 as the unpacked
    path (unquantised activations), and close to that path. Thresholds: those of the prefill test
    above, and KL 1e-3 against the unpacked path."""
    from conftest import prompt_logits

    model = load(qwen3_0_6b)
    prompts = [random_tokens(16, seed=s) for s in range(16)]

    def logits():
        return torch.cat([prompt_logits(model, p) for p in prompts])

    ref = logits()
    quantize_model(model, "int4")
    calls = []
    monkeypatch.setattr(cpu_kernels, "int4_gemv", counting(cpu_kernels.int4_gemv, calls))
    kernel = logits()
    assert len(calls) == 16 * (4 * 28 + 1)  # every linear of every layer, and the head
    without_kernels(monkeypatch)
    unpacked = logits()
    agree, kl = compare(ref, kernel)
    assert agree >= 0.15 and kl <= 0.06, f"top-1 agreement {agree:.3f}, KL {kl:.5f}"
    _, kl_unpacked = compare(unpacked, kernel)
    assert 0 < kl_unpacked <= 1e-3, f"KL against the unpacked path {kl_unpacked:.2e}"


def counting(fn, calls: list):
    def wrapper(*args):
        calls.append(1)
        return fn(*args)
    return wrapper


# ---------------------------------------------------------------- (c) wiring


def test_llm_int4_generates_the_same_alone_and_in_a_batch(tiny_bf16_dir):
    llm = LLM(tiny_bf16_dir, dtype="bfloat16", device="cpu", max_model_len=128,
              quantization="int4")
    model = llm.llm_engine.model
    assert llm.llm_engine.quantization == "int4" and isinstance(model.lm_head, Int4Linear)
    assert not any(type(m) in (Linear, ColumnParallelLinear, RowParallelLinear)
                   for m in model.modules())
    # prompts longer than 16 tokens: prefilled alone or together, they take the unpacked path
    prompts = [random_tokens(n, seed=n) for n in (17, 25, 40)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [llm.generate([p], greedy, use_tqdm=False)[0].token_ids for p in prompts]
    assert [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == alone
    int8 = LLM(tiny_bf16_dir, dtype="bfloat16", device="cpu", max_model_len=128,
               quantization="int8")
    assert [int8.generate([p], greedy, use_tqdm=False)[0].token_ids for p in prompts] != alone


def test_a_matrix_int4_cannot_cut_is_one_clear_error(checkpoint):
    path = checkpoint("tiny", dtype="bfloat16", intermediate_size=40)
    with pytest.raises(ConfigError, match=r"down_proj has 40"):
        LLM(path, dtype="bfloat16", device="cpu", max_model_len=64, quantization="int4")


def test_cli_generate_with_int4(tiny_bf16_dir):
    llm = LLM(tiny_bf16_dir, dtype="bfloat16", device="cpu", max_model_len=128,
              quantization="int4")
    prompt, params = "1, 2, 3,", SamplingParams(temperature=0, max_tokens=8)
    expected = llm.generate(prompt, params, use_tqdm=False)[0]
    r = run_cli("generate", "--model", str(tiny_bf16_dir), "--prompt", prompt, "--max-tokens", "8",
                "--temperature", "0", "--no-chat-template", "--dtype", "bfloat16",
                "--quantization", "int4", "--verbose")
    assert r.returncode == 0, r.stderr
    assert r.stdout == expected.text + "\n"
    # the speed line names the weights' format; the log (--verbose), the kernel
    assert "int4 weights" in r.stderr.splitlines()[-1]
    assert f"int4 rows: int8 activations, {cpu_kernels.int4_dot_instructions()}" in r.stderr


@pytest.fixture(scope="module")
def qwen3_0_6b(tmp_path_factory):
    if (BENCH_CHECKPOINT / "config.json").is_file():
        return BENCH_CHECKPOINT
    from nanoqwen.entrypoints.benchmark import ensure_random_checkpoint

    return ensure_random_checkpoint(tmp_path_factory.mktemp("qwen3-0.6b") / "random-bf16")


@pytest.fixture(scope="module")
def tiny_bf16_dir(tmp_path_factory):
    from nanoqwen.model_loader.init_random import write_random_model

    return write_random_model(tmp_path_factory.mktemp("tiny-bf16"), "tiny", dtype="bfloat16",
                              std=0.08)


@pytest.fixture(scope="module")
def moe_bf16_dir(tmp_path_factory):
    from nanoqwen.model_loader.init_random import write_random_model

    return write_random_model(tmp_path_factory.mktemp("moe-bf16"), "qwen3-moe-tiny",
                              dtype="bfloat16", std=0.08)
