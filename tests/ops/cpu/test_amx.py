"""int4 products on AMX tiles (nanoqwen/ops/cpu/csrc/amx.cpp, cpu_kernels.int4_amx) against int4_gemm's panels and
int4_gemv_reference, and how ops/cpu/selection.py chooses from how many rows int4 layers use them.

The tiles add each group's integer dot products into the same float32 operations, in the same order, as the
panels (int4_gemm), so the two must agree to the bit, and both stay within int4_gemv_reference's tolerance
(tests/ops/cpu/test_kernels.py check_int4). The kernel tests need a CPU with AMX-INT8 (an Intel Xeon from
Sapphire Rapids on) not limited to AVX2; the selection tests run anywhere. Below them, bf16 and int8 products on
AMX-BF16 tiles (cpu_kernels.bf16_amx, int8_amx) against their references, and where the layers use them.
"""

from __future__ import annotations

import pytest
import torch
from test_kernels import assert_within_one_ulp, check_int4, make_int4

from nanoqwen.ops.cpu import build as cpu_build
from nanoqwen.ops.cpu import kernels as cpu_kernels
from nanoqwen.ops.cpu import matmul as cpu
from nanoqwen.ops.cpu import probes as cpu_probes
from nanoqwen.ops.cpu import selection
from nanoqwen.ops.quantize import dequantize_int4, pack_int4
from nanoqwen.quantization.int4 import int4_linear
from nanoqwen.quantization.int8 import dequantized_linear, pick_kernel


def kernels_with_tiles(available, tiles: str):
    """cpu_kernels where the kernels and this kind of AMX tiles (available()) can run, else the test skips."""
    if not cpu_kernels.available():
        pytest.skip(f"CPU kernels not available here ({cpu_kernels._failure or 'NANOQWEN_CPU_GEMV=0'})")
    if not available():
        pytest.skip(f"no {tiles} tiles on this CPU (or limited to AVX2 by ATEN_CPU_CAPABILITY)")
    return cpu_kernels


@pytest.fixture(scope="module")
def amx():
    return kernels_with_tiles(cpu_kernels.amx_int8_available, "AMX-INT8")


@pytest.mark.parametrize("n", (1, 16, 17, 40, 300))  # one or two panels a pair of tiles, a part of one
@pytest.mark.parametrize("k, group", [(16, 16), (96, 32), (1024 + 64, 64), (256, 128), (1024, 64)])
@pytest.mark.parametrize("m", (1, 2, 15, 16, 17, 64, 70))  # tiles of 16 rows of x, and the rows left over
def test_amx_tiles_compute_the_panels_bits(amx, m, k, group, n):
    x, packed, scale, offset = make_int4(m, k, n, group)
    got = check_int4(amx, x, packed, scale, offset, kernel="int4_amx")
    assert torch.equal(got, amx.int4_gemm(x, packed, scale, offset))


def test_amx_tiles_with_float_and_two_level_scales(amx):
    x, packed, scale, offset = make_int4(20, 512, 40, 64)
    scale32 = torch.rand(scale.shape, generator=torch.Generator().manual_seed(1)) * 1e-2
    check_int4(amx, x, packed, scale32, -scale32 * 8, kernel="int4_amx")
    assert torch.equal(amx.int4_amx(x, packed, scale32, -scale32 * 8), amx.int4_gemm(x, packed, scale32, -scale32 * 8))
    g = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (40, 512), generator=g, dtype=torch.uint8)
    sub = [torch.randint(0, 64, (40, 16), generator=g, dtype=torch.uint8) for _ in range(2)]
    supers = [torch.rand(40, 2, generator=g) * 1e-3, -torch.rand(40, 2, generator=g) * 1e-3]
    two_level = pack_int4(q, *sub, *supers)
    magnitude = x.float().abs() @ dequantize_int4(*two_level).abs().T
    got = amx.int4_amx(x, *two_level)
    assert_within_one_ulp(got, amx.int4_gemv_reference(x, *two_level), magnitude)
    assert torch.equal(got, amx.int4_gemm(x, *two_level))


def test_amx_integer_sums_at_their_largest(amx):
    """Every nibble 15 and x quantised to +-127: the largest int32 sums a group's tile adds."""
    for m, k, group, n in [(16, 1024, 64, 32), (3, 2 * 128, 128, 16)]:
        packed = torch.full((n, k // 2), 0xFF, dtype=torch.uint8)
        scale = torch.full((n, k // group), 2.0**-12, dtype=torch.bfloat16)
        offset = torch.zeros(n, k // group, dtype=torch.bfloat16)
        x = -torch.ones(m, k, dtype=torch.bfloat16)
        got = check_int4(amx, x, packed, scale, offset, kernel="int4_amx")
        assert torch.allclose(got.float(), torch.full_like(got.float(), -k * 15 / 4096), rtol=2**-7)


def test_int4_gemv_takes_the_tiles_from_amx_min_rows_on(amx, monkeypatch):
    """int4_gemv(amx_min_rows=r) sends r or more rows to the tiles and fewer to its own passes; the one-call decode
    step's setting (set_int4_amx_min_rows) is the process's; int4_linear passes the path's choice."""
    x, packed, scale, offset = make_int4(16, 1024, 64, 64)
    for rows in (1, 4, 8, 16):
        assert torch.equal(amx.int4_gemv(x[:rows], packed, scale, offset, amx_min_rows=8),
                           amx.int4_gemm(x[:rows], packed, scale, offset))
    seen = []

    def spy(*args, amx_min_rows=0):
        seen.append(amx_min_rows)
        return amx.int4_gemm(*args)

    monkeypatch.setattr(cpu_kernels, "int4_gemv", spy)
    path = cpu.MatmulPath("bf16", "test", int4_amx_min_rows=4)
    assert torch.equal(int4_linear(x, packed, scale, offset, path), amx.int4_gemm(x, packed, scale, offset))
    assert seen == [4]


def test_the_tiles_are_not_used_when_limited_to_avx2(amx, monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert cpu_build.limited_to_avx2() and not amx.amx_int8_available()
    with pytest.raises(RuntimeError, match="AMX-INT8"):
        amx.int4_amx(*make_int4(2, 64, 16, 64))


SPEEDS = {2: (5.0, 20.0), 4: (9.0, 18.0), 8: (14.0, 9.0), 16: (16.0, 7.0), 32: (17.0, 4.0), 64: (18.0, 3.0)}


@pytest.mark.parametrize("speeds, expected", [
    (SPEEDS, 8),
    ({**SPEEDS, 4: (19.0, 18.0)}, 4),            # faster from 4 rows on
    ({**SPEEDS, 4: (19.0, 18.0), 8: (8.0, 9.0)}, 16),  # slower at 8: not from 4 on
    ({**SPEEDS, 64: (2.0, 3.0)}, 0),             # slower at the most rows: never
    ({r: (9.0, 1.0) for r in SPEEDS}, 2),
])
def test_amx_min_rows_is_where_the_tiles_stay_faster(speeds, expected):
    assert selection.amx_min_rows(speeds) == expected


def test_the_tiles_are_chosen_by_measurement_once_per_machine(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_kernels, "amx_int8_available", lambda: True)
    chosen = []
    monkeypatch.setattr(cpu_kernels, "set_int4_amx_min_rows", chosen.append)
    calls = []

    def probe():
        calls.append(1)
        return SPEEDS

    monkeypatch.setattr(cpu_probes, "int4_amx_probe", probe)
    monkeypatch.setenv("NANOQWEN_CPU_AMX", "auto")
    base = cpu.MatmulPath("bf16", "test")
    first = selection.select_int4_amx(base, tmp_path)
    assert first.int4_amx_min_rows == 8 and "8: 14.0 vs 9.0" in first.int4_amx_reason and chosen == [8]
    assert "int4 products of >= 8 rows on AMX tiles" in first.describe()
    assert selection.select_int4_amx(base, tmp_path) == first and len(calls) == 1  # from the cache
    monkeypatch.setattr(cpu_build, "build_digest", lambda: "changed kernels")
    assert selection.select_int4_amx(base, tmp_path) == first and len(calls) == 2  # measured again
    monkeypatch.setenv("NANOQWEN_CPU_AMX", "1")
    assert selection.select_int4_amx(base, tmp_path).int4_amx_min_rows == 2 and chosen[-1] == 2
    monkeypatch.setenv("NANOQWEN_CPU_AMX", "0")
    assert selection.select_int4_amx(base, tmp_path) == base and chosen[-1] == 0
    monkeypatch.setenv("NANOQWEN_CPU_AMX", "auto")
    monkeypatch.setattr(cpu_kernels, "amx_int8_available", lambda: False)  # an AVX2-only CPU: no probe
    assert selection.select_int4_amx(base, tmp_path) == base and len(calls) == 2 and chosen[-1] == 0


def test_the_amx_probe_measures_both_kernels(monkeypatch):
    seen = set()
    monkeypatch.setattr(cpu_probes, "AMX_PROBE_SHAPE", (32, 128, 2))
    monkeypatch.setattr(cpu_kernels, "int4_amx", lambda x, *w: seen.add(("amx", x.shape[0])))
    monkeypatch.setattr(cpu_kernels, "int4_gemv", lambda x, *w: seen.add(("gemv", x.shape[0])))
    speeds = cpu_probes.int4_amx_probe()
    assert sorted(speeds) == list(cpu_probes.AMX_PROBE_ROWS)
    assert seen == {(kernel, rows) for kernel in ("amx", "gemv") for rows in cpu_probes.AMX_PROBE_ROWS}


def test_an_int4_model_decodes_the_same_bits_with_the_tiles(amx, checkpoint, monkeypatch):
    """Three sequences decoding together through an int4 model, module by module and in the one-call decode step,
    without the tiles and with them from 2 rows on: the same tokens and logprobs to the last bit."""
    from nanoqwen import LLM, SamplingParams

    monkeypatch.setenv("NANOQWEN_CPU_MATMUL", "bf16")
    monkeypatch.setenv("NANOQWEN_CPU_GEMV", "1")
    path = checkpoint("gqa2-untied", dtype="bfloat16")
    prompts = [[(7 * i + 3) % 5000 + 100 for i in range(n)] for n in (5, 17, 30)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    seen = []
    original = cpu_kernels.int4_gemv
    monkeypatch.setattr(cpu_kernels, "int4_gemv", lambda *a, amx_min_rows=0: seen.append(amx_min_rows)
                        or original(*a, amx_min_rows=amx_min_rows))
    outputs = {}
    for tiles in ("0", "1"):
        for fused in ("0", "1"):
            monkeypatch.setenv("NANOQWEN_CPU_AMX", tiles)
            monkeypatch.setenv("NANOQWEN_FUSED_DECODE", fused)
            llm = LLM(path, dtype="bfloat16", device="cpu", max_model_len=128, quantization="int4")
            assert ("AMX tiles" in llm.llm_engine.kernel_path) == (tiles == "1")
            outputs[tiles, fused] = [(o.token_ids, repr(o.logprobs))
                                     for o in llm.generate(prompts, params, use_tqdm=False)]
    assert 2 in seen and 0 in seen  # the module path passed the choice
    assert len({repr(v) for v in outputs.values()}) == 1
    cpu_kernels.set_int4_amx_min_rows(0)


# ---- bf16 products on AMX-BF16 tiles (cpu_kernels.bf16_amx) and MatmulPath's use of them

@pytest.fixture(scope="module")
def amx_bf16():
    return kernels_with_tiles(cpu_kernels.amx_bf16_available, "AMX-BF16")


@pytest.mark.parametrize("k, n", [(32, 16), (1024 + 32, 48), (2048, 160)])  # one or two weight tiles a block
@pytest.mark.parametrize("m", (1, 5, 16, 17, 32, 33, 64))  # one or two blocks of x a pass, and a second pass
def test_bf16_amx_is_the_bf16_product(amx_bf16, m, k, n):
    """bf16_amx computes bf16_gemv_reference's function (float32 sums, one rounding) within its float32 order."""
    g = torch.Generator().manual_seed(m * 7 + k + n)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    got = amx_bf16.bf16_amx(x, w)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    assert_within_one_ulp(got, amx_bf16.bf16_gemv_reference(x, w), x.float().abs() @ w.float().abs().T)
    # each output its own (a weight row or a row of x moved changes only its own outputs)
    assert torch.equal(amx_bf16.bf16_amx(x.flip(0), w.flip(0)), got.flip(0, 1))


def test_bf16_amx_refuses_shapes_it_does_not_take(amx_bf16):
    x = torch.randn(4, 64).bfloat16()
    with pytest.raises(RuntimeError, match="K a multiple of 32 and N of 16"):
        amx_bf16.bf16_amx(x[:, :48], torch.randn(16, 48).bfloat16())
    with pytest.raises(RuntimeError, match="K a multiple of 32 and N of 16"):
        amx_bf16.bf16_amx(x, torch.randn(24, 64).bfloat16())
    with pytest.raises(RuntimeError, match="bfloat16"):
        amx_bf16.bf16_amx(x.float(), torch.randn(16, 64))


def test_linear_takes_the_bf16_tiles_for_their_rows(amx_bf16, monkeypatch):
    """MatmulPath.linear sends bf16 products of bf16_amx_min_rows .. AMX_MAX_ROWS rows to the tiles (a bias added
    after), fewer to the gemv kernels, more and shapes the tiles do not take to torch."""
    seen, original = [], cpu_kernels.bf16_amx
    monkeypatch.setattr(cpu_kernels, "bf16_amx", lambda x, w: seen.append(x.shape[0]) or original(x, w))
    path = cpu.MatmulPath("bf16", "test", gemv_max_rows=4, bf16_amx_min_rows=8)
    g = torch.Generator().manual_seed(3)
    w, bias = (torch.randn(64, 128, generator=g) / 12).bfloat16(), torch.randn(64, generator=g).bfloat16()
    for rows in (4, 8, 64, 65):
        x = torch.randn(rows, 128, generator=g).bfloat16()
        torch.testing.assert_close(path.linear(x, w, bias), torch.nn.functional.linear(x, w, bias), atol=0.05,
                                   rtol=0.02)
    path.linear(torch.randn(16, 120).bfloat16(), torch.randn(64, 120).bfloat16())  # K not a multiple of 32
    assert seen == [8, 64]
    assert "bf16 products of 8-64 rows on AMX tiles" in path.describe()


@pytest.mark.parametrize("kind, against", [("bf16", "torch"), ("int8", "int8_gemv")])
def test_the_bf16_and_int8_tiles_are_chosen_by_measurement_once_per_machine(kind, against, monkeypatch, tmp_path):
    """select_bf16_amx / select_int8_amx: the probe's choice, cached; NANOQWEN_CPU_AMX forces it; no AMX-BF16 tiles,
    no probe."""
    select = getattr(selection, f"select_{kind}_amx")

    def rows(choice: cpu.MatmulPath) -> int:
        return getattr(choice, f"{kind}_amx_min_rows")

    monkeypatch.setattr(cpu_kernels, "amx_bf16_available", lambda: True)
    calls = []
    monkeypatch.setattr(cpu_probes, f"{kind}_amx_probe", lambda: calls.append(1) or SPEEDS)
    monkeypatch.setenv("NANOQWEN_CPU_AMX", "auto")
    base = cpu.MatmulPath("bf16", "test")
    first = select(base, tmp_path)
    assert rows(first) == 8 and f"tiles vs {against}: 2: 5.0 vs 20.0" in getattr(first, f"{kind}_amx_reason")
    assert select(base, tmp_path) == first and len(calls) == 1  # from the cache
    monkeypatch.setenv("NANOQWEN_CPU_AMX", "1")
    assert rows(select(base, tmp_path)) == 2
    monkeypatch.setenv("NANOQWEN_CPU_AMX", "0")
    assert select(base, tmp_path) == base
    monkeypatch.setenv("NANOQWEN_CPU_AMX", "auto")
    monkeypatch.setattr(cpu_kernels, "amx_bf16_available", lambda: False)  # no AMX-BF16: no probe
    assert select(base, tmp_path) == base and len(calls) == 1


@pytest.mark.parametrize("kind, other", [("bf16", "linear"), ("int8", "int8_gemv")])
def test_the_bf16_and_int8_amx_probes_measure_both_kernels(kind, other, monkeypatch):
    seen = set()
    monkeypatch.setattr(cpu_probes, "AMX_PROBE_SHAPE", (32, 128, 4))
    monkeypatch.setattr(cpu_kernels, f"{kind}_amx", lambda x, *w: seen.add(("amx", x.shape[0])))
    monkeypatch.setattr(cpu_probes.F if other == "linear" else cpu_kernels, other,
                        lambda x, *w: seen.add(("other", x.shape[0])))
    speeds = getattr(cpu_probes, f"{kind}_amx_probe")()
    assert sorted(speeds) == list(cpu_probes.AMX_PROBE_ROWS)
    assert seen == {(kernel, rows) for kernel in ("amx", "other") for rows in cpu_probes.AMX_PROBE_ROWS}


# ---- int8 products on AMX-BF16 tiles (cpu_kernels.int8_amx) and the int8 layers' use of them

@pytest.mark.parametrize("k, n", [(32, 16), (1024 + 32, 48), (2048, 160)])
@pytest.mark.parametrize("m", (1, 5, 16, 17, 33, 64))
def test_int8_amx_is_the_int8_product(amx_bf16, m, k, n):
    """int8_amx computes int8_linear_reference's function (float32 sums times the row's scale, one rounding)
    within its float32 order; the int8 values, widened exactly, reach the tiles at their full range."""
    g = torch.Generator().manual_seed(m * 5 + k + n)
    x = torch.randn(m, k, generator=g).bfloat16()
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    q[0, :32] = torch.tensor([-128, 127] * 16, dtype=torch.int8)
    scale = (torch.rand(n, generator=g) / (64 * k**0.5)).bfloat16()
    got = amx_bf16.int8_amx(x, q, scale)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    magnitude = (x.float().abs() @ q.float().abs().T) * scale.float()
    assert_within_one_ulp(got, amx_bf16.int8_linear_reference(x, q, scale), magnitude)
    assert torch.equal(amx_bf16.int8_amx(x.flip(0), q.flip(0), scale.flip(0)), got.flip(0, 1))
    assert torch.equal(amx_bf16.int8_amx(x.view(m, 1, k), q, scale).view(m, n), got)


def test_int8_amx_refuses_shapes_it_does_not_take(amx_bf16):
    x, q, scale = torch.randn(4, 64).bfloat16(), torch.zeros(16, 64, dtype=torch.int8), torch.ones(16).bfloat16()
    with pytest.raises(RuntimeError, match="K a multiple of 32, N of 16 and a scale per row"):
        amx_bf16.int8_amx(x, q[:8], scale[:8])
    with pytest.raises(RuntimeError, match="K a multiple of 32, N of 16 and a scale per row"):
        amx_bf16.int8_amx(x, q, scale[:8])
    with pytest.raises(RuntimeError, match="int8"):
        amx_bf16.int8_amx(x, q.bfloat16(), scale)


def test_int8_layers_take_the_tiles_for_their_rows():
    """An int8 product of bf16 rows goes to the tiles from int8_amx_min_rows to AMX_MAX_ROWS rows, for a matrix
    whose rows are a multiple of 16 and inputs of 32; fewer rows, more, and other shapes take the other kernels."""
    path = cpu.MatmulPath("bf16", "test", gemv_max_rows=4, int8_amx_min_rows=8)
    rows_kernel = {rows: pick_kernel(torch.empty(rows, 128, dtype=torch.bfloat16), 128, path, 64)
                   for rows in (4, 7, 8, 64, 65)}
    assert rows_kernel == {4: cpu_kernels.int8_gemv, 7: cpu_kernels.int8_gemv, 8: cpu_kernels.int8_amx,
                           64: cpu_kernels.int8_amx, 65: dequantized_linear}
    assert pick_kernel(torch.empty(16, 128, dtype=torch.bfloat16), 128, path, 40) is cpu_kernels.int8_gemv
    assert pick_kernel(torch.empty(16, 120, dtype=torch.bfloat16), 120, path, 64) is cpu_kernels.int8_gemv
    assert pick_kernel(torch.empty(16, 128, dtype=torch.bfloat16), 128, cpu.MatmulPath("bf16", "test",
                       gemv_max_rows=4), 64) is cpu_kernels.int8_gemv
    assert "int8 products of 8-64 rows on AMX tiles" in path.describe()
