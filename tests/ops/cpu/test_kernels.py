"""The CPU matrix-vector kernels (nanoqwen/ops/cpu/kernels.py) against their plain-torch references, and the
fallback when they cannot be built.

Kernel and reference both accumulate in float32 and round to bf16 once; only the order of the float32
additions differs, so each output may differ from the reference by at most one bf16 rounding step (1 ulp of
the output) plus the float32 summation error. That error matters only where the sum cancels to nearly zero,
so the tolerance adds 1e-5 (about 170 float32 ulps) of the sum of the terms' magnitudes.

Input contract (tested below): non-contiguous inputs work (they are copied); wrong dtypes, shapes or
mismatched K raise RuntimeError naming the argument.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from nanoqwen.attention.backends.paged import paged_decode_attention_reference
from nanoqwen.attention.backends.sdpa import prefill_attention_blocked
from nanoqwen.models import qwen3
from nanoqwen.models.qwen3 import attention_reference
from nanoqwen.ops.cpu import build as cpu_build
from nanoqwen.ops.cpu import kernels as cpu_kernels
from nanoqwen.ops.hf_quants import dequantize_fp8
from nanoqwen.ops.quantize import (
    dequantize_int4,
    dequantize_int8_group,
    pack_int4,
    pack_int5,
    pack_int6,
    packed_bits,
    quantize_int4,
    two_level_scales,
    unpack_int5,
    unpack_int6,
)

MS = (1, 2, 3, 5, 8)
KS = (16, 17, 100, 1024 + 7)
NS = (1, 3, 257)


@pytest.fixture(scope="module")
def kernels():
    if not cpu_kernels.available():
        pytest.skip(f"CPU gemv kernels not available here ({cpu_kernels._failure or 'NANOQWEN_CPU_GEMV=0'})")
    return cpu_kernels


def bf16_ulp(y: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |y| (8 significant bits): 2^(exponent - 7); the smallest normal's below."""
    y = y.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    return torch.exp2(torch.floor(torch.log2(y)) - 7)


def assert_within_one_ulp(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor) -> None:
    """got == want within 1 bf16 ulp, plus float32 noise relative to `magnitude` (sum of |terms| per output)."""
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    diff = (got.float() - want.float()).abs()
    allowed = torch.maximum(bf16_ulp(want), bf16_ulp(got)) + 1e-5 * magnitude
    worst = (diff - allowed).max().item() if diff.numel() else 0.0
    assert worst <= 0, f"max abs difference beyond 1 bf16 ulp by {worst}"


def make(m: int, k: int, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed * 1000 + m * 100 + k * 10 + n)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scale = (torch.rand(n, generator=g) / 64 / k**0.5).to(torch.bfloat16)
    return x, w, bias, q, scale


def check_bf16(kernels, x, w, bias=None) -> torch.Tensor:
    got = kernels.bf16_gemv(x, w, bias)
    magnitude = x.float().abs() @ w.float().abs().T + (0 if bias is None else bias.float().abs())
    assert_within_one_ulp(got, kernels.bf16_gemv_reference(x, w, bias), magnitude)
    return got


def check_int8(kernels, x, q, scale) -> torch.Tensor:
    got = kernels.int8_gemv(x, q, scale)
    magnitude = (x.float().abs() @ q.float().abs().T) * scale.float().abs()
    assert_within_one_ulp(got, kernels.int8_gemv_reference(x, q, scale), magnitude)
    return got


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("m", MS)
def test_bf16_gemv_matches_reference(kernels, m, k, n):
    x, w, bias, _, _ = make(m, k, n)
    check_bf16(kernels, x, w)
    check_bf16(kernels, x, w, bias)


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("m", MS)
def test_int8_gemv_matches_reference(kernels, m, k, n):
    x, _, _, q, scale = make(m, k, n)
    check_int8(kernels, x, q, scale)


@pytest.mark.parametrize("m", (17, 64))
def test_int8_gemv_matches_reference_over_a_batch_of_rows(kernels, m):
    """Batched decode steps on the bf16 path run up to GEMV_MAX_ROWS rows through int8_gemv."""
    x, _, _, q, scale = make(m, 1024 + 7, 257)
    check_int8(kernels, x, q, scale)


def test_mostly_bit_exact(kernels):
    # Differing only in summation order, nearly all outputs round to the same bf16 value.
    x, w, bias, q, scale = make(4, 1024 + 7, 257)
    for got, want in ((kernels.bf16_gemv(x, w, bias), kernels.bf16_gemv_reference(x, w, bias)),
                      (kernels.int8_gemv(x, q, scale), kernels.int8_gemv_reference(x, q, scale))):
        assert (got == want).float().mean().item() > 0.95


@pytest.mark.parametrize("m", (9, 11, 13, 16, 17, 35))
def test_many_rows(kernels, m):
    # Up to 16 rows go in one pass over the weights, in register groups of up to 4 (9 -> 3 + 3 + 3,
    # 11 -> 3 + 4 + 4, 16 -> 4 * 4); more rows take further passes (17 -> 16 + 1, 35 -> 16 + 16 + 3).
    x, w, bias, q, scale = make(m, 100, 33)
    check_bf16(kernels, x, w, bias)
    check_int8(kernels, x, q, scale)


def test_leading_dims(kernels):
    x, w, bias, q, scale = make(11, 100, 33)
    x3 = x[:10].reshape(2, 5, 100)
    y = kernels.int8_gemv(x3, q, scale)
    assert y.shape == (2, 5, 33)
    assert torch.equal(y, kernels.int8_gemv(x[:10], q, scale).view(2, 5, 33))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_multithreaded_split_matches(kernels, threads):
    # Enough rows that the threads share N (a task reads >= 256 KB of weights: 128 bf16 rows of 1024, 256 int8,
    # 512 int4): each its own part of the first rows, then chunks of the rest from a shared counter. An odd
    # count, so neither the parts nor the chunks split evenly into the kernel's streams. Every row must be
    # computed (a skipped chunk leaves torch.empty's garbage), right, and the same way on every call (where
    # the chunks are cut does not depend on which thread takes them). One thread: at::parallel_for as before.
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x, w, bias, q, scale = make(2, 1024, 2001)
        y = check_bf16(kernels, x, w, bias)
        assert all(torch.equal(y, kernels.bf16_gemv(x, w, bias)) for _ in range(5))
        y = check_int8(kernels, x, q, scale)
        assert all(torch.equal(y, kernels.int8_gemv(x, q, scale)) for _ in range(5))
        x, packed, scale, offset = make_int4(2, 1024, 2001, 64)
        y = check_int4(kernels, x, packed, scale, offset)
        assert all(torch.equal(y, kernels.int4_gemv(x, packed, scale, offset)) for _ in range(5))
    finally:
        torch.set_num_threads(before)


def test_non_contiguous_inputs_work(kernels):
    x, w, bias, q, scale = make(3, 64, 40)
    xt = x.t().contiguous().t()  # same values, transposed strides
    wt = w.t().contiguous().t()
    bias2 = torch.stack([bias, bias], 1)[:, 0]  # stride 2
    assert not (xt.is_contiguous() or wt.is_contiguous() or bias2.is_contiguous())
    assert torch.equal(kernels.bf16_gemv(xt, wt, bias2), kernels.bf16_gemv(x, w, bias))
    qt = q.t().contiguous().t()
    assert torch.equal(kernels.int8_gemv(xt, qt, scale), kernels.int8_gemv(x, q, scale))


def test_wrong_inputs_raise(kernels):
    x, w, bias, q, scale = make(2, 32, 8)
    with pytest.raises(RuntimeError, match="x must be bfloat16"):
        kernels.bf16_gemv(x.float(), w)
    with pytest.raises(RuntimeError, match="w must be BFloat16"):
        kernels.bf16_gemv(x, w.half())
    with pytest.raises(RuntimeError, match="q must be Char"):
        kernels.int8_gemv(x, w, scale)
    with pytest.raises(RuntimeError, match="scale must be bfloat16"):
        kernels.int8_gemv(x, q, scale.float())
    with pytest.raises(RuntimeError, match=r"bias must have shape \[8\]"):
        kernels.bf16_gemv(x, w, bias[:4])
    with pytest.raises(RuntimeError, match="K=31"):
        kernels.bf16_gemv(x[:, :31], w)


# ---- bf16_gemm (csrc/gemm.cpp): x in panels of 6 rows, weights in panels of 16 columns, depth blocks of 256,
# column blocks of 256 per thread, row sweeps of 96. Each size below leaves a remainder at one or more of them.
GEMM_SIZES = [(1, 1, 1), (5, 7, 15), (7, 9, 17), (13, 300, 33), (100, 257, 300), (97, 520, 1100),
              (257, 1024 + 7, 530)]


def check_gemm(kernels, x, w) -> torch.Tensor:
    got = kernels.bf16_gemm(x, w)
    magnitude = x.float().abs() @ w.float().abs().T
    assert_within_one_ulp(got, kernels.bf16_gemv_reference(x, w), magnitude)
    return got


@pytest.mark.parametrize("m, k, n", GEMM_SIZES)
def test_bf16_gemm_matches_reference(kernels, m, k, n):
    x, w, _, _, _ = make(m, k, n)
    got = check_gemm(kernels, x, w)
    assert (got == kernels.bf16_gemv_reference(x, w)).float().mean().item() > 0.95
    # float32 x: a float32 product of the same terms, not rounded
    got32 = kernels.bf16_gemm(x.float(), w)
    want32 = torch.nn.functional.linear(x.float(), w.float())
    assert got32.dtype == torch.float32
    assert ((got32 - want32).abs() <= 1e-5 * (x.float().abs() @ w.float().abs().T) + 1e-30).all()


@pytest.mark.parametrize("m, k, n", GEMM_SIZES)
def test_int8_gemm_matches_reference(kernels, m, k, n):
    x, _, _, q, scale = make(m, k, n)
    got = kernels.int8_gemm(x, q, scale)
    magnitude = (x.float().abs() @ q.float().abs().T) * scale.float().abs()
    want = kernels.int8_linear_reference(x, q, scale)
    assert_within_one_ulp(got, want, magnitude)
    assert (got == want).float().mean().item() > 0.95


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_bf16_gemm_threads_split_columns_the_same_way(kernels, threads):
    """Threads take ranges of 16-column panels (3 threads: uneven ones); each output's sum runs in the same
    order whoever computes it, so every thread count gives the same bits."""
    x, w, _, _, _ = make(97, 520, 1100)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = kernels.bf16_gemm(x, w)
        torch.set_num_threads(threads)
        assert torch.equal(kernels.bf16_gemm(x, w), one)
    finally:
        torch.set_num_threads(before)
    check_gemm(kernels, x, w)


def test_bf16_gemm_shapes_and_inputs(kernels):
    x, w, _, _, _ = make(10, 40, 33)
    y = kernels.bf16_gemm(x.reshape(2, 5, 40), w)  # leading dims
    assert y.shape == (2, 5, 33) and torch.equal(y, kernels.bf16_gemm(x, w).view(2, 5, 33))
    xt, wt = x.t().contiguous().t(), w.t().contiguous().t()  # non-contiguous: copied
    assert torch.equal(kernels.bf16_gemm(xt, wt), kernels.bf16_gemm(x, w))
    assert kernels.bf16_gemm(x[:0], w).shape == (0, 33)
    assert torch.equal(kernels.bf16_gemm(x[:, :0], w[:, :0]), torch.zeros(10, 33, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="x must be bfloat16 or float32"):
        kernels.bf16_gemm(x.half(), w)
    with pytest.raises(RuntimeError, match="w must be a 2-D BFloat16"):
        kernels.bf16_gemm(x, w.float())
    with pytest.raises(RuntimeError, match="x's last dimension must be 40"):
        kernels.bf16_gemm(x[:, :39], w)
    _, _, _, q, scale = make(10, 40, 33)
    with pytest.raises(RuntimeError, match="q must be a 2-D Char"):
        kernels.int8_gemm(x, w, scale)
    with pytest.raises(RuntimeError, match=r"scale must have shape \[33\]"):
        kernels.int8_gemm(x, q, scale[:5])


# q heads, kv heads, D, prompt tokens, cached tokens: blocks of 128 queries (the last one partial), GQA groups of
# 1 and 2, D not a multiple of 16, more keys than a depth block (256) of the values' product
@pytest.mark.parametrize("hq, hkv, d, t, num_cached", [(4, 2, 32, 150, 0), (4, 2, 32, 150, 37), (2, 1, 40, 5, 300),
                                                       (3, 3, 16, 129, 0), (16, 8, 128, 300, 0)])
def test_prefill_attention_matches_the_blocked_reference(kernels, monkeypatch, hq, hkv, d, t, num_cached):
    """One C++ call computes prefill_attention_blocked's function on the float32 path (scores and probabilities
    rounded to bf16 where it rounds them): within a bf16 rounding of it, nearly all outputs the same bits, and
    within the documented definition's tolerance of attention_reference."""
    g = torch.Generator().manual_seed(t + num_cached)
    q = torch.randn(t, hq, d, generator=g).bfloat16()
    k = torch.randn(num_cached + t, hkv, d, generator=g).bfloat16()
    v = torch.randn(num_cached + t, hkv, d, generator=g).bfloat16()
    got = kernels.prefill_attention(q, k, v, num_cached, d**-0.5, 128)
    want = prefill_attention_blocked(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), num_cached,
                                     upcast=True).transpose(0, 1)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, atol=0.01, rtol=0.016)
    assert (got == want).float().mean().item() > 0.99
    pos = torch.arange(num_cached, num_cached + t)[:, None]
    mask = (torch.arange(num_cached + t)[None, :] <= pos)[None, None]
    ref = attention_reference(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask)[0]
    torch.testing.assert_close(got, ref.transpose(0, 1), atol=0.03, rtol=0.02)
    # k and v as views of another layout (copied), and the threads taking the tasks in another order: same bits
    k2, v2 = k.transpose(0, 1).contiguous().transpose(0, 1), v.transpose(0, 1).contiguous().transpose(0, 1)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(kernels.prefill_attention(q, k2, v2, num_cached, d**-0.5, 128), got)
    finally:
        torch.set_num_threads(before)


def test_prefill_attention_wrong_inputs_raise(kernels):
    q, k = torch.zeros(4, 2, 8, dtype=torch.bfloat16), torch.zeros(4, 1, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="3-D bfloat16"):
        kernels.prefill_attention(q.float(), k, k, 0, 1.0, 128)
    with pytest.raises(RuntimeError, match=r"k and v \[num_cached \+ T, Hkv, D\]"):
        kernels.prefill_attention(q, k, k, 2, 1.0, 128)


@pytest.fixture
def fresh_state(monkeypatch):
    """cpu_kernels with its cached build state reset (restored after the test)."""
    monkeypatch.setattr(cpu_kernels, "_ext", None)
    monkeypatch.setattr(cpu_kernels, "_failure", None)
    return monkeypatch


def test_env_var_disables_without_building(fresh_state):
    builds = []

    def no_build():  # (an exception here would be caught by available() as a failed build: counted instead)
        builds.append(1)
        raise AssertionError("must not build")

    fresh_state.setenv("NANOQWEN_CPU_GEMV", "0")
    fresh_state.setattr(cpu_build, "build", no_build)
    assert not cpu_kernels.available()
    assert builds == []
    with pytest.raises(RuntimeError, match="NANOQWEN_CPU_GEMV=0"):
        cpu_kernels.bf16_gemv(torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(2, 8, dtype=torch.bfloat16))


def test_build_failure_warns_once(fresh_state, caplog):
    from torch.utils import cpp_extension

    calls = []

    def failing_load(*args, **kwargs):
        calls.append(kwargs.get("name"))
        raise RuntimeError("Error building extension: no compiler")

    fresh_state.delenv("NANOQWEN_CPU_GEMV", raising=False)
    fresh_state.setattr(cpu_build, "compile_flags", lambda: ["-O3"])  # also on CPUs without AVX2
    fresh_state.setattr(cpp_extension, "load", failing_load)
    with caplog.at_level(logging.WARNING, logger="nanoqwen"):
        assert not cpu_kernels.available()
        assert not cpu_kernels.available()
    assert len(calls) == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no compiler" in warnings[0].getMessage()
    with pytest.raises(RuntimeError, match="not available"):
        cpu_kernels.int8_gemv(torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(2, 8, dtype=torch.int8),
                           torch.ones(2, dtype=torch.bfloat16))


def test_a_killed_builds_lock_is_removed_not_waited_on_forever(fresh_state, tmp_path, caplog):
    """A build killed midway leaves its lock file; torch would wait on it forever, hanging every later start.
    An old lock is removed with a warning; a fresh one (a build in progress) is waited for until it goes."""
    import os
    import threading
    import time

    from torch.utils import cpp_extension

    seen = []

    def load(**kwargs):  # what the build finds when it starts
        seen.append((Path(kwargs["build_directory"]) / "lock").exists())
        raise RuntimeError("stop here")

    fresh_state.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    fresh_state.setattr(cpu_build, "compile_flags", lambda: ["-O3"])  # also on CPUs without AVX2
    fresh_state.setattr(cpp_extension, "load", load)
    folder = cpu_build.build_directory()
    assert folder.is_relative_to(tmp_path) and f"torch{torch.__version__}" in folder.parent.name
    folder.mkdir(parents=True)
    lock = folder / "lock"
    lock.touch()
    old = time.time() - cpu_build.STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING, logger="nanoqwen"), pytest.raises(RuntimeError, match="stop here"):
        cpu_build.build()
    assert seen == [False] and "did not finish" in caplog.text
    lock.touch()  # a build in progress: its lock goes when it ends
    threading.Timer(0.3, lock.unlink).start()
    with pytest.raises(RuntimeError, match="stop here"):
        cpu_build.build()
    assert seen == [False, False]  # (the build ran once the other's lock was gone)


def test_no_avx2_is_a_failure(fresh_state, caplog):
    fresh_state.delenv("NANOQWEN_CPU_GEMV", raising=False)
    fresh_state.setattr(cpu_build, "cpu_name_and_flags", lambda: ("some CPU", {"sse2"}))
    with caplog.at_level(logging.WARNING, logger="nanoqwen"):
        assert not cpu_kernels.available()
    assert "AVX2" in caplog.text


def test_build_name_changes_with_every_source_file(tmp_path, monkeypatch):
    """The build is named by a hash of the kernels' files (build_digest): an edit to any of them, the shared
    header too, gives a new name, so a stale build of the old sources is never loaded."""
    import shutil

    sources = sorted(cpu_build.SOURCE_DIR.iterdir())
    assert {p.suffix for p in sources} == {".cpp", ".h"}
    for path in sources:
        shutil.copy(path, tmp_path / path.name)
    monkeypatch.setattr(cpu_build, "SOURCE_DIR", tmp_path)
    monkeypatch.setattr(cpu_build, "compile_flags", lambda: ["-O3"])  # also on CPUs without AVX2
    names = {cpu_build.build_digest()}
    for path in sources:
        copy = tmp_path / path.name
        copy.write_text(copy.read_text() + "\n// edited\n")
        names.add(cpu_build.build_digest())
    assert len(names) == len(sources) + 1


# ---- int4 (the format of nanoqwen/ops/quantize.py)


def make_int4(m: int, k: int, n: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed * 1000 + m * 100 + k + n)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16)
    return x, *quantize_int4(w, group)


def check_int4(kernels, x, packed, scale, offset, kernel: str = "int4_gemv") -> torch.Tensor:
    got = getattr(kernels, kernel)(x, packed, scale, offset)
    magnitude = x.float().abs() @ dequantize_int4(packed, scale, offset).abs().T
    assert_within_one_ulp(got, kernels.int4_gemv_reference(x, packed, scale, offset), magnitude)
    return got


@pytest.mark.parametrize("n", NS)
# (1024, 64): Qwen3-0.6B's hidden size, whole blocks of 8 groups; (1024 + 64, 64): one group left over
@pytest.mark.parametrize("k, group", [(16, 16), (96, 32), (1024, 64), (1024 + 64, 64), (256, 128),
                                      (1024 + 128, 128)])
@pytest.mark.parametrize("m", MS + (9,))
def test_int4_gemv_matches_reference(kernels, m, k, group, n):
    check_int4(kernels, *make_int4(m, k, n, group))


@pytest.mark.parametrize("n", (1, 15, 16, 17, 40))  # panels of 16 weight rows: less than one, one, a part
@pytest.mark.parametrize("k, group", [(16, 16), (96, 32), (1024 + 64, 64), (256, 128)])
@pytest.mark.parametrize("m", (1, 3, 4, 5, 8, 9, 70))  # tiles of 4 rows of x, and the rows left over
def test_int4_gemm_panels_match_reference(kernels, m, k, group, n):
    check_int4(kernels, *make_int4(m, k, n, group), kernel="int4_gemm")


def test_int4_gemv_and_its_panels_compute_the_same_bits(kernels):
    """int4_gemv streams the weights for up to 8 rows and computes more through int4_gemm's panels; both add
    each group's integer sums into the same float32 operations in the same order (the last, partial block of
    rows too), so a prompt and a decode step get the same bits whichever path a row count takes."""
    x, packed, scale, offset = make_int4(77, 1024, 300, 64)  # 300 rows: 18 blocks of 16 and one of 12
    for rows in (1, 3, 8, 9, 77):
        assert torch.equal(kernels.int4_gemv(x[:rows], packed, scale, offset),
                           kernels.int4_gemm(x[:rows], packed, scale, offset))
    y = kernels.int4_gemm(x[:10].reshape(2, 5, 1024), packed, scale, offset)
    assert y.shape == (2, 5, 300) and torch.equal(y.view(10, 300), kernels.int4_gemm(x[:10], packed, scale, offset))


def test_int4_gemv_leading_dims(kernels):
    x, packed, scale, offset = make_int4(3, 1024, 1001, 64)  # odd row count
    check_int4(kernels, x, packed, scale, offset)
    y = kernels.int4_gemv(x[:2].reshape(2, 1, 1024), packed, scale, offset)
    assert y.shape == (2, 1, 1001) and torch.equal(y[:, 0], kernels.int4_gemv(x[:2], packed, scale, offset))


@pytest.mark.parametrize("threads", [2, 3])
def test_int4_gemv_threads_steal_work_and_get_the_same_bits(kernels, threads):
    """The threads share the blocks of rows by work stealing (cpu_kernels.h, parallel_rows_stealing): where the
    shares are cut differs from call to call, but every block is computed once, alone, so the output equals the
    one-thread output to the bit, call after call. 3205 rows of 1024 (200 blocks of 16 and one of 5) are 6 tasks
    of at least 256 KB, so each thread count in the test gets a share."""
    x, packed, scale, offset = make_int4(2, 1024, 16 * 200 + 5, 64)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = check_int4(kernels, x[:1], packed, scale, offset), check_int4(kernels, x, packed, scale, offset)
        torch.set_num_threads(threads)
        for _ in range(20):
            assert torch.equal(kernels.int4_gemv(x[:1], packed, scale, offset), alone[0])
            assert torch.equal(kernels.int4_gemv(x, packed, scale, offset), alone[1])
    finally:
        torch.set_num_threads(before)


def test_int8_gemv_quantises_x_to_int16_in_blocks(kernels):
    """int8_gemv reads x rounded to int16 in blocks of 64: an outlier of 2^15 sets its block's scale to about 1,
    so the block's values under 1/2 round to 0 and no longer count, while the next block (its own scale, and
    the last block of K = 64 + 36 shorter) keeps them. int8_linear_reference, on x as it is, counts them. (The
    outlier meets zero weights, so that the small values' products are not lost in its output's rounding.)"""
    assert cpu_kernels.INT8_X_BLOCK == 64
    g = torch.Generator().manual_seed(3)
    q = torch.randint(-128, 128, (5, 100), generator=g, dtype=torch.int8)
    q[:, 3] = 0
    scale = torch.full((5,), 2.0**-6, dtype=torch.bfloat16)
    x = torch.zeros(1, 100, dtype=torch.bfloat16)
    x[0, 3] = 2.0**15
    small = torch.linspace(0.01, 0.3, 36).to(torch.bfloat16)
    with_small = x.clone()
    with_small[0, 10:46] += small  # in the outlier's block (elements 0-63): rounded away
    with_small[0, 64:] = small  # the last block, of its own: kept
    only_second = x.clone()
    only_second[0, 64:] = small
    got = check_int8(kernels, with_small, q, scale)
    assert torch.equal(got, kernels.int8_gemv(only_second, q, scale))
    assert not torch.equal(got, kernels.int8_gemv(x, q, scale))
    assert not torch.equal(got, kernels.int8_linear_reference(with_small, q, scale))
    x_read = cpu_kernels.quantize_activations(with_small, 64, levels=32767)
    assert torch.equal(x_read[0, :64] != 0, x[0, :64] != 0)
    assert (x_read[0, 64:] - small.float()).abs().max() <= small.float().max() / 32767 / 2 + 1e-9  # half a step


@pytest.mark.parametrize("kernel", ["int4_gemv", "int4_gemm"])
def test_int4_gemv_quantises_x_to_int8_in_blocks_of_the_group_size(kernels, kernel):
    """An outlier of 127 sets its block's scale to 1: the block's small values round to 0 and no longer
    count, while the next block (its own scale) keeps its small values."""
    x, packed, scale, offset = make_int4(1, 128, 5, 64)
    x = torch.zeros_like(x)
    x[0, 3] = 127
    small = torch.linspace(0.01, 0.3, 64).to(torch.bfloat16)
    with_small = x.clone()
    with_small[0, :64] += small * (torch.arange(64) != 3)  # in the outlier's block: rounded away
    with_small[0, 64:] = small  # a block of its own: kept
    only_second = x.clone()
    only_second[0, 64:] = small
    got = check_int4(kernels, with_small, packed, scale, offset, kernel)
    product = getattr(kernels, kernel)
    assert torch.equal(got, product(only_second, packed, scale, offset))
    assert not torch.equal(got, product(x, packed, scale, offset))
    x_read = cpu_kernels.quantize_activations(with_small, 64)
    assert torch.equal(x_read[0, :64], x[0, :64].float())
    assert (x_read[0, 64:] - small.float()).abs().max() <= small.float().max() / 127 / 2 + 1e-6  # half a step


@pytest.mark.parametrize("sign", ["+", "-", "random"])
def test_int4_integer_sums_at_their_largest(kernels, sign):
    """Every nibble 15 and every x quantised to +-127: the largest integer products there are. Without VNNI the
    kernels add up to 8 of maddubs's int16 pair sums (each 2 * 15 * 127 = 3810 here) in int16 before widening
    them (30480 < 32767); one more, or a group whose chunk count is not a multiple of the widening's (G = 16:
    2 chunks, 4 quads; G = 48: 6 chunks, 12 quads), would wrap past 32767 and be off by 65536 somewhere."""
    g = torch.Generator().manual_seed(5)
    for m, k, group, n in [(1, 3 * 48, 48, 19), (2, 5 * 16, 16, 32), (9, 2 * 128, 128, 16), (3, 1024, 64, 40)]:
        packed = torch.full((n, k // 2), 0xFF, dtype=torch.uint8)  # both nibbles of every byte: 15
        scale = torch.full((n, k // group), 2.0**-12, dtype=torch.bfloat16)
        offset = torch.zeros(n, k // group, dtype=torch.bfloat16)
        x = torch.ones(m, k, dtype=torch.bfloat16)  # each block's scale 1/127: x quantised to 127
        if sign == "-":
            x = -x
        elif sign == "random":
            x = torch.where(torch.rand(m, k, generator=g) < 0.5, x, -x)
        for kernel in ("int4_gemv", "int4_gemm"):
            got = check_int4(kernels, x, packed, scale, offset, kernel)
            if sign != "random":  # every output: k * 15 / 4096, the same sign as x
                assert torch.allclose(got.float(), torch.full_like(got.float(), float(x[0, 0]) * k * 15 / 4096),
                                      rtol=2**-7)


def test_integer_kernels_without_vnni_match_references(tmp_path):
    """With the CPU limited to AVX2 (ATEN_CPU_CAPABILITY=avx2) the kernels are built without AVX-512 VNNI
    (maddubs instead of vpdpbusd for int4, vpmaddwd instead of vpdpwssd for int8), as on an AVX2-only CPU;
    the same references hold, for int4's streaming passes and panels (their int16 sums at their largest too)
    and for int8_gemv."""
    import os
    import subprocess
    import sys

    if not cpu_kernels.available():
        pytest.skip("CPU gemv kernels not available here")
    script = (
        "import sys, torch; sys.path.insert(0, 'tests'); sys.path.insert(0, 'tests/ops/cpu')\n"
        "from test_kernels import make, make_int4, check_int4, check_int8\n"
        "from test_kernels import test_int8_gemv_quantises_x_to_int16_in_blocks as int16_blocks\n"
        "from test_kernels import test_int4_integer_sums_at_their_largest as largest_sums\n"

        "from nanoqwen.ops.cpu import kernels as k\n"
        "from nanoqwen.ops.cpu.build import compile_flags\n"
        "assert k.available() and k.int4_dot_instructions() == 'AVX2', compile_flags()\n"
        "assert k.bf16_dot_instructions() == 'AVX2 FMA', compile_flags()\n"
        "for m, kk, group, n in [(1, 1024 + 64, 64, 257), (3, 256, 128, 3), (5, 96, 32, 7), (9, 1024, 64, 65)]:\n"
        "    check_int4(k, *make_int4(m, kk, n, group))\n"
        "    check_int4(k, *make_int4(m + 4, kk, n, group), kernel='int4_gemm')\n"
        "for m, kk, n in [(1, 1024 + 7, 257), (3, 100, 3), (16, 64, 65)]:\n"
        "    x, _, _, q, scale = make(m, kk, n)\n"
        "    assert (check_int8(k, x, q, scale) == k.int8_gemv_reference(x, q, scale)).float().mean() > 0.95\n"
        "int16_blocks(k)\n"
        "for sign in ('+', '-', 'random'):\n"
        "    largest_sums(k, sign)\n"

        "print('ok')\n")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2"}
    root = Path(__file__).resolve().parents[3]
    r = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_int4_dot_instructions_names_the_build_before_any_kernel_ran(kernels, monkeypatch):
    """The log line's instruction name matches the build's flags even when asked before any kernel was
    loaded (it said "AVX2" on a VNNI CPU then)."""
    want = "AVX-512 VNNI" if "-mavx512vnni" in cpu_build.compile_flags() else "AVX2"
    monkeypatch.setattr(kernels, "_ext", None)  # as in a fresh process: available() loads it again
    assert kernels.int4_dot_instructions() == want


def test_bf16_dot_instructions_name_the_build(kernels, monkeypatch):
    """bf16_gemv's instructions, as the log line names them, follow the build's flags: AVX-512 BF16 dot
    products where the CPU has them (and is not limited to AVX2), else FMAs on widened weights."""
    want = "AVX-512 BF16 dot products" if "-mavx512bf16" in cpu_build.compile_flags() else "AVX2 FMA"
    monkeypatch.setattr(kernels, "_ext", None)  # as in a fresh process: available() loads it again
    assert kernels.bf16_dot_instructions() == want
    assert kernels._ext.has_bf16_dot() == (want != "AVX2 FMA")


def test_int4_wrong_inputs_raise(kernels):
    x, packed, scale, offset = make_int4(2, 64, 8, 32)
    with pytest.raises(RuntimeError, match="packed must be uint8"):
        kernels.int4_gemv(x, packed.view(torch.int8), scale, offset)
    with pytest.raises(RuntimeError, match="whole multiple of 16"):  # 64 / 8 groups = 8 per group
        kernels.int4_gemv(x, packed, scale.repeat(1, 4), offset.repeat(1, 4))
    with pytest.raises(RuntimeError, match="K=32"):
        kernels.int4_gemv(x[:, :32], packed, scale, offset)
    with pytest.raises(RuntimeError, match="scale and offset must have the same dtype"):
        kernels.int4_gemv(x, packed, scale, offset.float())
    with pytest.raises(RuntimeError, match="scale must be bfloat16, float32, float16 or"):
        kernels.int4_gemv(x, packed, scale.double(), offset.double())
    with pytest.raises(RuntimeError, match="go with super_scale and super_offset"):
        kernels.int4_gemv(x, packed, scale.to(torch.uint8), offset.to(torch.uint8))


# ---- the rest of a decode step


def test_add_rms_norm_is_the_bf16_add_then_rms_norm(kernels):
    """decode_model's residual add and the norm after it, one call: h is torch's bf16 x + y and the norm is rms_norm
    of h, bit for bit (rows of vectors only, vectors and a scalar tail, and no vector at all)."""
    g = torch.Generator().manual_seed(0)
    for rows, d in ((1, 1024), (3, 20), (2, 6)):
        x, y = (4 * torch.randn(2, rows, d, generator=g)).bfloat16()
        w = torch.randn(d, generator=g).bfloat16()
        h, normed = kernels.add_rms_norm(x, y, w, 1e-6)
        assert torch.equal(h, x + y)
        assert torch.equal(normed, kernels.rms_norm(x + y, w, 1e-6))
    with pytest.raises(RuntimeError, match=r"x and y must be \[M, D\] alike"):
        kernels.add_rms_norm(x, y[:1], w, 1e-6)
    with pytest.raises(RuntimeError, match=r"weight must have shape \[6\]"):
        kernels.add_rms_norm(x, y, w[:4], 1e-6)


def test_rms_norm_rope_and_swiglu_round_where_the_reference_rounds(kernels):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, 128, generator=g).bfloat16()
    for shape in ((3, 16, 128), (2, 1024), (1, 8, 24)):
        x = (4 * torch.randn(*shape, generator=g)).bfloat16()
        w = torch.randn(shape[-1], generator=g).bfloat16()
        got, want = kernels.rms_norm(x, w, 1e-6), qwen3.rms_norm(x, w, 1e-6)
        assert_within_one_ulp(got, want, torch.zeros(()))
        assert (got == want).float().mean() > 0.99  # only the order of the float32 sum differs
    for n, heads, d in ((3, 5, 24), (2, 16, 128), (1, 2, 6)):  # vectors and a scalar tail, vectors only, no vector
        xr = (4 * torch.randn(n, heads, d, generator=g)).bfloat16()
        cos, sin = torch.randn(2, n, d, generator=g).bfloat16()
        assert torch.equal(kernels.apply_rope(xr, cos, sin), qwen3.apply_rope(xr, cos, sin))
    gate_up = (3 * torch.randn(2, 2 * 3072, generator=g)).bfloat16()
    got, want = kernels.swiglu(gate_up), qwen3.swiglu(gate_up)
    assert_within_one_ulp(got, want, torch.zeros(()))
    assert (got == want).float().mean() > 0.99  # (exp may differ from torch's in the last bit)
    with pytest.raises(RuntimeError, match="weight must have shape"):
        kernels.rms_norm(x, x[0, 0, :8], 1e-6)
    with pytest.raises(RuntimeError, match="x must be bfloat16"):
        kernels.apply_rope(x.float(), cos, sin)


def test_attention_inputs_match_the_kernels_one_by_one(kernels):
    """decode_model's QK-norm + RoPE + KV store in one pass equals rms_norm, apply_rope and index_copy_ called in
    turn, bit for bit: head widths with and without a scalar tail, scattered slots, GQA."""
    g = torch.Generator().manual_seed(5)
    for hq, hkv, d in ((16, 8, 128), (6, 3, 20), (4, 1, 24)):
        m, blocks, block_size = 3, 5, 4
        qkv = (3 * torch.randn(m, (hq + 2 * hkv) * d, generator=g)).bfloat16()
        q_norm, k_norm = (1 + torch.randn(2, d, generator=g) / 4).bfloat16()
        cos, sin = torch.randn(2, m, d, generator=g).bfloat16()
        slots = torch.tensor([17, 2, 9])
        k_cache, v_cache = torch.randn(2, blocks, block_size, hkv, d, generator=g).bfloat16()
        want_k, want_v = k_cache.clone(), v_cache.clone()
        q_part, k_part, v_part = qkv.split([hq * d, hkv * d, hkv * d], dim=1)
        want_q = kernels.apply_rope(kernels.rms_norm(q_part.reshape(m, hq, d), q_norm, 1e-6), cos, sin)
        k = kernels.apply_rope(kernels.rms_norm(k_part.reshape(m, hkv, d), k_norm, 1e-6), cos, sin)
        want_k.view(-1, hkv, d).index_copy_(0, slots, k)
        want_v.view(-1, hkv, d).index_copy_(0, slots, v_part.reshape(m, hkv, d))
        q = kernels.attention_inputs(qkv, q_norm, k_norm, 1e-6, hq, cos, sin, k_cache, v_cache, slots)
        assert torch.equal(q, want_q)
        assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    with pytest.raises(RuntimeError, match=r"slot_mapping\[1\]=20 is outside the cache \(20 slots\)"):
        kernels.attention_inputs(qkv, q_norm, k_norm, 1e-6, hq, cos, sin, k_cache, v_cache, torch.tensor([0, 20, 1]))
    with pytest.raises(RuntimeError, match="qkv must be"):
        kernels.attention_inputs(qkv, q_norm, k_norm, 1e-6, hq + 1, cos, sin, k_cache, v_cache, slots)


def test_paged_decode_attention_matches_reference(kernels):
    g = torch.Generator().manual_seed(1)
    # GQA 2, 4, 3 (query heads in pairs and one alone), 1 (no GQA: each head alone), a width not a multiple of 8
    for hq, hkv, d in ((16, 8, 128), (4, 1, 24), (6, 2, 32), (4, 4, 16), (6, 3, 20)):
        k_cache, v_cache = torch.randn(2, 20, 4, hkv, d, generator=g).bfloat16()
        q = torch.randn(4, hq, d, generator=g).bfloat16()
        # blocks out of order, a partly filled last block, a row with nothing to attend to (padding)
        tables = torch.tensor([[3, 7, 1, 0], [5, 0, 0, 0], [2, 4, 6, 8], [0, 0, 0, 0]], dtype=torch.int32)
        lens = torch.tensor([10, 3, 16, 0], dtype=torch.int32)
        got = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, d**-0.5)
        want = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, d**-0.5)
        torch.testing.assert_close(got, want, atol=4e-3, rtol=8e-3)  # 1 bf16 ulp
        assert torch.equal(got[3], torch.zeros_like(got[3]))
    with pytest.raises(RuntimeError, match="past its block table"):
        kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens + 17, d**-0.5)


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_paged_decode_attention_short_spans_for_the_threads(kernels, threads):
    """Where one sequence of fewer than 256 positions is cut into spans for the threads (at least 32 positions
    each), the combined spans still give the reference's attention: 100 positions over 4 threads (3 spans of 34),
    2 threads (2 of 50), 1 thread (one span), and a context too short to cut (40 positions: one span). It checks
    the results, not the cut itself (the bf16 output hides the order of the float32 sums)."""
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, block_size = 16, 8, 128, 16
    k_cache, v_cache = (3 * torch.randn(2, 8, block_size, hkv, d, generator=g)).bfloat16()
    tables = torch.tensor([[6, 1, 7, 0, 3, 2, 5]], dtype=torch.int32)
    q = torch.randn(1, hq, d, generator=g).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n in (100, 40):
            lens = torch.tensor([n], dtype=torch.int32)
            got = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, d**-0.5)
            want = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, d**-0.5)
            torch.testing.assert_close(got, want, atol=4e-3, rtol=8e-3)  # 1 bf16 ulp
    finally:
        torch.set_num_threads(before)



def tiny_decoder_model(kernels, rand, h: int, hq: int, hkv: int, d: int, inter: int, vocab: int):
    """decode_model's weights of a random two-layer model (rand(*shape): a bf16 tensor)."""
    layers = [kernels.decoder_layer_weights(
        input_norm=rand(h), post_norm=rand(h), eps=1e-6, qkv_proj=[("bf16", [rand((hq + 2 * hkv) * d, h)])],
        q_norm=rand(d), k_norm=rand(d), o_proj=[("bf16", [rand(h, hq * d)])],
        gate_up_proj=[("bf16", [rand(2 * inter, h)])], down_proj=[("bf16", [rand(h, inter)])],
        num_heads=hq) for _ in range(2)]
    return kernels.decoder_model_weights(embed=("bf16", [rand(vocab, h)]), cos=torch.rand(8, d), sin=torch.rand(8, d),
                                         layers=layers, norm=rand(h), eps=1e-6, lm_head=[("bf16", [rand(vocab, h)])])

def test_decode_model_takes_one_cache_per_layer(kernels):
    """decode_model runs layer i on caches [i] and refuses caches for another number of layers, naming them; it
    returns float32 logits, one row per token, a tensor of its own: the next calls leave it as it was, and a call
    whose kernels' outputs come from the pool of the last call's (cpu_kernels.h, new_output) gives the same bits as
    the first. (A pool that handed a kernel a buffer still in use would compute every call alike, so this test
    would not see it: test_cpu_path.py's fused-step test, against the module path, fails then.)"""
    g = torch.Generator().manual_seed(6)
    h, hq, hkv, d, inter, blocks, block_size, vocab = 32, 2, 1, 16, 48, 2, 4, 40

    def rand(*shape):
        return torch.randn(*shape, generator=g).bfloat16()

    model = tiny_decoder_model(kernels, rand, h, hq, hkv, d, inter, vocab)
    step = (torch.tensor([5]), torch.tensor([[1, 0]], dtype=torch.int32), torch.tensor([6], dtype=torch.int32))
    k_caches, v_caches = torch.zeros(2, 2, blocks, block_size, hkv, d, dtype=torch.bfloat16)
    logits = kernels.decode_model(model, torch.tensor([3]), torch.tensor([5]), k_caches, v_caches, *step)
    assert logits.dtype == torch.float32 and logits.shape == (1, vocab)
    assert k_caches[0].abs().sum() > 0 and k_caches[1].abs().sum() > 0  # each layer stored its key
    assert not torch.equal(k_caches[0], k_caches[1])
    first = logits.clone()
    other = kernels.decode_model(model, torch.tensor([7]), torch.tensor([5]), k_caches, v_caches, *step)
    again = kernels.decode_model(model, torch.tensor([3]), torch.tensor([5]), k_caches, v_caches, *step)
    assert not torch.equal(other, first) and torch.equal(logits, first) and torch.equal(again, first)
    with pytest.raises(RuntimeError, match=r"k_caches and v_caches must be \[2, blocks"):
        kernels.decode_model(model, torch.tensor([3]), torch.tensor([5]), k_caches[:1], v_caches[:1], *step)


def test_decode_model_adds_a_lora_adapter_and_refuses_malformed_ones(kernels):
    """decode_model's `lora` (decoder_lora_weights): an adapter whose A is zero adds exact zeros (the base logits,
    bit for bit), one with random A and B on a single linear changes them, and decode_steps takes it too; a linear's
    adapter that is not bf16 (a [R, in], b [out, R]) and an adapter of another number of layers are refused.
    (That the adapter's products are the LoRA hooks', bit for bit: tests/lora/test_fused_lora.py.)"""
    g = torch.Generator().manual_seed(7)
    h, hq, hkv, d, inter, r, vocab = 32, 2, 1, 16, 48, 4, 40

    def rand(*shape):
        return torch.randn(*shape, generator=g).bfloat16()

    model = tiny_decoder_model(kernels, rand, h, hq, hkv, d, inter, vocab)
    none = dict(qkv_proj=[], o_proj=[], gate_up_proj=[], down_proj=[])

    def adapter(a: torch.Tensor, b: torch.Tensor) -> object:  # on layer 1's down_proj only
        return kernels.decoder_lora_weights([kernels.decoder_layer_lora(**none),
                                             kernels.decoder_layer_lora(**{**none, "down_proj": [a, b]})])

    def logits(lora: object | None) -> torch.Tensor:
        caches = torch.zeros(2, 2, 2, 4, hkv, d, dtype=torch.bfloat16)
        step = (torch.tensor([5]), torch.tensor([[1, 0]], dtype=torch.int32), torch.tensor([6], dtype=torch.int32))
        return kernels.decode_model(model, torch.tensor([3]), torch.tensor([5]), *caches, *step, lora=lora)

    base = logits(None)
    assert torch.equal(logits(adapter(torch.zeros(r, inter, dtype=torch.bfloat16), rand(h, r))), base)
    lora = adapter(rand(r, inter), rand(h, r))
    assert not torch.allclose(logits(lora), base, atol=1e-2)
    steps = [kernels.decode_steps(model, torch.tensor([3]), *torch.zeros(2, 2, 2, 4, hkv, d, dtype=torch.bfloat16),
                                  torch.tensor([[1, 0]], dtype=torch.int32), torch.tensor([6], dtype=torch.int32),
                                  torch.full((1, 1), -1), 2, lora=x) for x in (None, lora)]
    assert steps[0][0].item() == base.argmax().item() and steps[1][0].item() == logits(lora).argmax().item()
    with pytest.raises(RuntimeError, match="bf16"):
        adapter(rand(r, inter).float(), rand(h, r))
    with pytest.raises(RuntimeError, match="bf16"):
        adapter(rand(r, inter), rand(h, r + 1))
    with pytest.raises(RuntimeError, match="the adapter has 1 layers, the model 2"):
        logits(kernels.decoder_lora_weights([kernels.decoder_layer_lora(**none)]))


def test_paged_decode_attention_long_contexts(kernels):
    """Contexts of several spans (the kernel splits a row's positions into spans of at most 256 and
    combines their softmax sums): uneven spans, shuffled blocks, GQA 2, and a padding row among them."""
    g = torch.Generator().manual_seed(2)
    hq, hkv, d, block_size = 16, 8, 128, 16
    lens = torch.tensor([700, 257, 0, 1500], dtype=torch.int32)
    blocks = int((lens + block_size - 1).div(block_size, rounding_mode="floor").sum())
    k_cache, v_cache = (3 * torch.randn(2, blocks, block_size, hkv, d, generator=g)).bfloat16()
    tables = torch.randint(blocks, (4, 94), generator=g, dtype=torch.int32)  # (rows may share blocks)
    q = torch.randn(4, hq, d, generator=g).bfloat16()
    got = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, d**-0.5)
    want = paged_decode_attention_reference(q, k_cache, v_cache, tables, lens, d**-0.5)
    torch.testing.assert_close(got, want, atol=4e-3, rtol=8e-3)  # 1 bf16 ulp
    assert torch.equal(got[2], torch.zeros_like(got[2]))


# ---- a GGUF file's formats: int4 with float32 scales, grouped int8 (nanoqwen/quantization/prequantized.py)


@pytest.mark.parametrize("m", (1, 3, 9, 40))  # the streaming passes and the panels
@pytest.mark.parametrize("n", (16, 40))
def test_int4_gemv_with_float32_scales(kernels, m, n):
    """Scales and offsets in float32 (a GGUF file's exact ones, groups of 32): the same function as the reference,
    and the bf16-scale kernels' result where the scales are bf16 values."""
    x, packed, scale, offset = make_int4(m, 256, n, 32)
    got = check_int4(kernels, x, packed, scale.float(), offset.float())
    assert torch.equal(got, kernels.int4_gemv(x, packed, scale, offset))
    g = torch.Generator().manual_seed(m + n)  # scales that bf16 cannot hold
    scale32 = torch.rand(scale.shape, generator=g) * 1e-2
    check_int4(kernels, x, packed, scale32, -scale32 * 8)


@pytest.mark.parametrize("m", (1, 3, 9, 40))
def test_int4_gemv_with_two_level_scales(kernels, m):
    """Q4_K's scales as the file holds them: 6-bit sub-scales and mins (uint8) times a float32 pair per 8 groups;
    streaming passes and panels compute the reference's function."""
    g = torch.Generator().manual_seed(m)
    n, k = 40, 512
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    sub = [torch.randint(0, 64, (n, k // 32), generator=g, dtype=torch.uint8) for _ in range(2)]
    supers = [torch.rand(n, k // 256, generator=g) * 1e-3, -torch.rand(n, k // 256, generator=g) * 1e-3]
    packed = pack_int4(q, *sub, *supers)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    magnitude = x.float().abs() @ dequantize_int4(*packed).abs().T
    for kernel in (kernels.int4_gemv, kernels.int4_gemm):
        assert_within_one_ulp(kernel(x, *packed), kernels.int4_gemv_reference(x, *packed), magnitude)
    one_level = pack_int4(q, two_level_scales(sub[0], supers[0]), two_level_scales(sub[1], supers[1]))
    assert torch.equal(kernels.int4_gemv(x, *packed), kernels.int4_gemv(x, *one_level))


@pytest.mark.parametrize("m", (1, 5, 16))
def test_int8_group_gemv_with_two_level_scales(kernels, m):
    """Q6_K's scales as the file holds them: int8 sub-scales a group of 16 times a float32 per 16 groups."""
    g = torch.Generator().manual_seed(m)
    n, k = 37, 512
    q = torch.randint(-32, 32, (n, k), generator=g, dtype=torch.int8)
    sub, super_scale = torch.randint(-128, 128, (n, k // 16), generator=g, dtype=torch.int8), torch.rand(n, 2) * 1e-4
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    got = kernels.int8_group_gemv(x, q, sub, None, super_scale)
    magnitude = x.float().abs() @ dequantize_int8_group(q, sub, None, super_scale).abs().T
    assert_within_one_ulp(got, kernels.int8_group_gemv_reference(x, q, sub, None, super_scale), magnitude)
    assert torch.equal(got, kernels.int8_group_gemv(x, q, two_level_scales(sub, super_scale), None))


def make_int8_group(m: int, k: int, n: int, group: int, offset: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed + m * 100 + k + n + group)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, k // group, generator=g) * 4e-3
    return x, q, scale, (torch.randn(n, k // group, generator=g) * 1e-2 if offset else None)


@pytest.mark.parametrize("offset", [False, True], ids=["symmetric", "offset"])
@pytest.mark.parametrize("group", (16, 32))
@pytest.mark.parametrize("m", (1, 2, 3, 4, 5, 16))
def test_int8_group_gemv_matches_reference(kernels, m, group, offset):
    x, q, scale, off = make_int8_group(m, 1024, 67, group, offset)
    got = kernels.int8_group_gemv(x, q, scale, off)
    w = q.float().view(67, -1, group) * scale[..., None] + (0 if off is None else off[..., None])
    magnitude = x.float().abs() @ w.view(67, -1).abs().T
    assert_within_one_ulp(got, kernels.int8_group_gemv_reference(x, q, scale, off), magnitude)
    assert torch.equal(kernels.int8_group_gemv(x.view(m, 1, 1024), q, scale, off).view(m, 67), got)
    with pytest.raises(RuntimeError, match="group size is 16 or 32"):
        kernels.int8_group_gemv(x, q, scale[:, :8].contiguous(), None)


def test_int6_packing_round_trips_and_the_kernel_reads_it(kernels):
    """Q6_K's values packed at 6 bits (24 bytes per 32): pack_int6 / unpack_int6 give back every value, and
    int8_group_gemv reading the packed bytes computes what it computes from the int8 values."""
    g = torch.Generator().manual_seed(6)
    q = torch.randint(-32, 32, (37, 512), generator=g, dtype=torch.int8)
    packed = pack_int6(q)
    assert packed.shape == (37, 384) and torch.equal(unpack_int6(packed), q)
    sub, super_scale = torch.randint(-128, 128, (37, 32), generator=g, dtype=torch.int8), torch.rand(37, 2) * 1e-4
    for m in (1, 3, 16):
        x = torch.randn(m, 512, generator=g).to(torch.bfloat16)
        assert torch.equal(kernels.int8_group_gemv(x, packed, sub, None, super_scale),
                           kernels.int8_group_gemv(x, q, sub, None, super_scale))
    with pytest.raises(RuntimeError, match="multiple of 32"):  # (the packed layout's chunks are 32 values)
        kernels.int8_group_gemv(x[:, :48].contiguous(), q[:, :48].contiguous(), sub[:, :3].contiguous(), None)


@pytest.mark.parametrize("group", (16, 32))
def test_int5_packing_round_trips_and_the_kernel_reads_it(kernels, group):
    """The Q5 types' values packed at 5 bits (20 bytes per 32): pack_int5 / unpack_int5 give back every value, and
    int8_group_gemv reading the packed bytes computes what it computes from the int8 values."""
    g = torch.Generator().manual_seed(5)
    q = torch.randint(0, 32, (37, 512), generator=g, dtype=torch.int8)
    packed = pack_int5(q)
    assert packed.shape == (37, 320) and torch.equal(unpack_int5(packed), q)
    assert packed_bits(packed, 512 // group) == 5 and packed_bits(pack_int6(q), 512 // group) == 6
    scale, offset = torch.rand(37, 512 // group, generator=g) * 1e-2, torch.randn(37, 512 // group, generator=g) * 1e-2
    for m in (1, 3, 16):
        x = torch.randn(m, 512, generator=g).to(torch.bfloat16)
        got = kernels.int8_group_gemv(x, packed, scale, offset)
        assert torch.equal(got, kernels.int8_group_gemv(x, q, scale, offset))
        magnitude = x.float().abs() @ dequantize_int8_group(q, scale, offset).abs().T
        assert_within_one_ulp(got, kernels.int8_group_gemv_reference(x, packed, scale, offset), magnitude)


def test_symmetric_five_bit_values_take_their_offsets_from_the_scales(kernels):
    """5-bit values without offsets (a GGUF file's Q5_0, each weight d * (q - 16)): the kernel, its dequantise and the
    reference compute exactly what they compute given the offsets -16 d."""
    g = torch.Generator().manual_seed(50)
    packed = pack_int5(torch.randint(0, 32, (37, 512), generator=g, dtype=torch.int8))
    scale = (torch.rand(37, 16, generator=g) * 1e-2).half()
    offset = -16 * scale.float()
    for m in (1, 3, 16):
        x = torch.randn(m, 512, generator=g).to(torch.bfloat16)
        got = kernels.int8_group_gemv(x, packed, scale, None)
        assert torch.equal(got, kernels.int8_group_gemv(x, packed, scale.float(), offset))
        assert torch.equal(kernels.int8_group_gemv_reference(x, packed, scale, None),
                           kernels.int8_group_gemv_reference(x, packed, scale.float(), offset))
    want = dequantize_int8_group(packed, scale.float(), offset)
    assert torch.equal(dequantize_int8_group(packed, scale, None), want)
    assert torch.equal(kernels.int8_group_dequantize(packed, scale, None, None, None, 512), want)

@pytest.mark.parametrize("m", (1, 5, 16))
def test_int8_group_gemv_with_two_level_scales_and_offsets(kernels, m):
    """Q5_K's scales and offsets as the file holds them: 6-bit uint8 sub-scales and mins a group of 32 times a float32
    d and -dmin per 8 groups; the same products as the one-level float32 values they stand for (exact)."""
    g = torch.Generator().manual_seed(m)
    n, k = 37, 512
    q = pack_int5(torch.randint(0, 32, (n, k), generator=g, dtype=torch.int8))
    sub = [torch.randint(0, 64, (n, k // 32), generator=g, dtype=torch.uint8) for _ in range(2)]
    supers = [torch.rand(n, 2, generator=g) * 1e-3, -torch.rand(n, 2, generator=g) * 1e-3]
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    got = kernels.int8_group_gemv(x, q, sub[0], sub[1], *supers)
    magnitude = x.float().abs() @ dequantize_int8_group(q, sub[0], sub[1], *supers).abs().T
    assert_within_one_ulp(got, kernels.int8_group_gemv_reference(x, q, sub[0], sub[1], *supers), magnitude)
    one_level = [two_level_scales(sub[0], supers[0]), two_level_scales(sub[1], supers[1])]
    assert torch.equal(got, kernels.int8_group_gemv(x, q, *one_level))
    assert not torch.equal(got, kernels.int8_group_gemv(x, q, sub[0], None, supers[0]))  # (the offsets count)
    with pytest.raises(RuntimeError, match="needs super_offset"):
        kernels.int8_group_gemv(x, q, sub[0], sub[1], supers[0])
    with pytest.raises(RuntimeError, match="super_scale goes with int8 or uint8"):
        kernels.int8_group_gemv(x, q, one_level[0], None, supers[0])


@pytest.mark.parametrize("bits", (8, 6, 5))
@pytest.mark.parametrize("form", ["float32", "float16", "two-level"])
def test_int8_group_dequantize_is_the_reference_bit_for_bit(kernels, bits, form):
    """The prompt path's weights from int8, 6- or 5-bit values with each form of scales and offsets: exactly
    dequantize_int8_group's float32 matrix (a product, then a sum)."""
    g = torch.Generator().manual_seed(bits)
    n, k, group = 37, 512, 16 if bits == 6 else 32
    low, high = {8: (-128, 128), 6: (-32, 32), 5: (0, 32)}[bits]
    q = torch.randint(low, high, (n, k), generator=g, dtype=torch.int8)
    packed = {8: q, 6: pack_int6(q), 5: pack_int5(q)}[bits]
    groups = k // group
    if form == "two-level":
        args = (torch.randint(0, 64, (n, groups), generator=g, dtype=torch.uint8),
                torch.randint(0, 64, (n, groups), generator=g, dtype=torch.uint8),
                torch.rand(n, 2, generator=g) * 1e-3, -torch.rand(n, 2, generator=g) * 1e-3)
    else:
        scale, offset = torch.rand(n, groups, generator=g) * 1e-2, torch.randn(n, groups, generator=g) * 1e-2
        args = ((scale.half(), offset.half()) if form == "float16" else (scale, offset)) + (None, None)
    want = dequantize_int8_group(packed, *args)
    assert torch.equal(kernels.int8_group_dequantize(packed, *args, k), want)
    assert torch.equal(kernels.int8_group_dequantize(packed, args[0], None, args[2], None, k),
                       dequantize_int8_group(packed, args[0], None, args[2], None))
    assert torch.equal(want, dequantize_int8_group(q, *args))


def test_int8_group_gemv_takes_float16_scales(kernels):
    """Q8_0's, Q5_0's and Q5_1's d and m held in float16 (as the file holds them): the same products as in
    float32."""
    x, q, scale, offset = make_int8_group(3, 512, 37, 32, True)
    scale, offset = scale.half(), offset.half()
    got = kernels.int8_group_gemv(x, q, scale, offset)
    assert torch.equal(got, kernels.int8_group_gemv(x, q, scale.float(), offset.float()))
    assert torch.equal(kernels.int8_group_gemv(x, q, scale, None), kernels.int8_group_gemv(x, q, scale.float(), None))
    assert not torch.equal(got, kernels.int8_group_gemv(x, q, scale, offset.float() * 2))


@pytest.mark.parametrize("m", (1, 3, 5, 16))
@pytest.mark.parametrize("k", (256, 300))  # whole blocks of 128, and a last partial block
def test_fp8_gemv_matches_reference(kernels, m, k):
    """e4m3 weights (normal and subnormal values, both signs) widened as they are read, scaled per row and block."""
    g = torch.Generator().manual_seed(m + k)
    w = (torch.randn(70, k, generator=g) * 60).to(torch.float8_e4m3fn)
    w[0, :16] = torch.arange(16, dtype=torch.uint8).view(torch.float8_e4m3fn)  # every subnormal and the smallest
    w[1, :16] = (torch.arange(16, dtype=torch.uint8) | 0x80).view(torch.float8_e4m3fn)  # negative ones
    scale = torch.rand(70, -(-k // 128), generator=g) * 1e-2
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    got = kernels.fp8_gemv(x, w, scale)
    magnitude = x.float().abs() @ dequantize_fp8(w, scale).abs().T
    assert_within_one_ulp(got, kernels.fp8_gemv_reference(x, w, scale), magnitude)


@pytest.mark.parametrize("m", (1, 9))
def test_int4_gemv_with_float16_scales(kernels, m):
    """Scales and offsets in float16 (a GGUF file's Q4_0 and Q4_1 ones, exact there): the float32 scales' bits."""
    x, packed, scale, offset = make_int4(m, 256, 40, 32)
    scale16, offset16 = scale.half(), offset.half()
    got = kernels.int4_gemv(x, packed, scale16, offset16)
    assert torch.equal(got, kernels.int4_gemv(x, packed, scale16.float(), offset16.float()))
    check_int4(kernels, x, packed, scale16, offset16)


@pytest.mark.parametrize("m", (1, 3, 9, 17))
@pytest.mark.parametrize("n", (48, 37))
def test_int4_gemv_without_offsets_is_symmetric(kernels, m, n):
    """No offsets (a GGUF file's Q4_0): each weight scale * (q - 8), the bits of the same matrix given its offsets
    -8 scale (exact in float16), in the streaming passes (<= 8 rows), the panels, and a last partial block (n = 37)."""
    x, packed, scale, _ = make_int4(m, 256, n, 32)
    scale16 = scale.half()
    offset16 = -8 * scale16
    assert torch.equal(dequantize_int4(packed, scale16, None), dequantize_int4(packed, scale16, offset16))
    assert torch.equal(kernels.int4_gemv(x, packed, scale16, None), kernels.int4_gemv(x, packed, scale16, offset16))
    assert torch.equal(kernels.int4_gemm(x, packed, scale16, None), kernels.int4_gemm(x, packed, scale16, offset16))
    check_int4(kernels, x, packed, scale16, None)
    with pytest.raises(ValueError, match="need their offsets"):
        dequantize_int4(packed, scale16.to(torch.uint8), None, scale.float()[:, :1], scale.float()[:, :1])
