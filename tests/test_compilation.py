"""torch.compile'd elementwise kernels compute what the plain functions in models/qwen3.py
compute."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest
import torch

from nanoqwen import LLM, SamplingParams
from nanoqwen.compilation import (
    FUNCTIONS,
    MIN_COMPILED_TOKENS,
    compile_kernels,
    select_kernels,
    use_eager_kernels,
)
from nanoqwen.models import qwen3


@pytest.fixture
def compiled():
    assert compile_kernels(torch.device("cpu"), torch.float32)
    yield qwen3.kernels
    compile_kernels(torch.device("cpu"), torch.float32)  # leave the default state for later tests


def test_compiled_kernels_equal_the_reference_functions(compiled):
    assert compiled.rms_norm is not qwen3.rms_norm  # really swapped in
    g = torch.Generator().manual_seed(0)
    # the small calls run eager; the compiled functions are tested directly too
    for n in (1, 5, MIN_COMPILED_TOKENS):
        compiled = SimpleNamespace(**{name: getattr(qwen3.kernels, name).compiled
                                      for name in FUNCTIONS}) \
            if n < MIN_COMPILED_TOKENS else qwen3.kernels
        for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
            x = torch.randn(n, 4, 32, generator=g).to(dtype)
            w = (torch.rand(32, generator=g) + 0.5).to(dtype)
            cos = torch.randn(n, 32, generator=g).to(dtype)
            sin = torch.randn(n, 32, generator=g).to(dtype)
            with torch.inference_mode():
                pairs = [(compiled.rms_norm(x, w, 1e-6), qwen3.rms_norm(x, w, 1e-6)),
                         (compiled.rms_norm(x.view(n, 128), w.repeat(4), 1e-6),
                          qwen3.rms_norm(x.view(n, 128), w.repeat(4), 1e-6)),
                         (compiled.apply_rope(x, cos, sin), qwen3.apply_rope(x, cos, sin)),
                         (compiled.swiglu(x.view(n, 128)), qwen3.swiglu(x.view(n, 128)))]
            for got, want in pairs:
                assert got.shape == want.shape and got.dtype == want.dtype
                torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_only_calls_on_many_tokens_take_the_compiled_kernel(compiled, monkeypatch):
    calls = []
    monkeypatch.setattr(qwen3.kernels.swiglu, "compiled",
                        lambda x: calls.append(x.shape[0]) or qwen3.swiglu(x))
    with torch.inference_mode():
        for n in (1, 16, MIN_COMPILED_TOKENS - 1, MIN_COMPILED_TOKENS, 300):
            qwen3.kernels.swiglu(torch.randn(n, 8))
    assert calls == [MIN_COMPILED_TOKENS, 300]


def test_engine_compiles_by_default_and_matches_enforce_eager(tiny_dir, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # an 83-token prefill step: the compiled kernels' range
    prompts = [list(range(1, 81)), [9, 8, 7]]
    kwargs = dict(dtype="float32", device="cpu", max_model_len=128)
    eager = LLM(tiny_dir, enforce_eager=True, **kwargs)
    assert qwen3.kernels.rms_norm is qwen3.rms_norm  # enforce_eager puts the plain functions back
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    compiled = LLM(tiny_dir, **kwargs)
    assert qwen3.kernels.rms_norm is not qwen3.rms_norm
    calls = []
    original = qwen3.kernels.swiglu.compiled
    monkeypatch.setattr(qwen3.kernels.swiglu, "compiled",
                        lambda x: calls.append(x.shape[0]) or original(x))
    got = [o.outputs[0].token_ids for o in compiled.generate(prompts, params, use_tqdm=False)]
    assert got == want
    # the prefill went through the compiled kernel
    assert calls and min(calls) >= MIN_COMPILED_TOKENS


def test_kernels_follow_each_engines_choice(compiled):
    """Each (device, dtype) keeps its compiled kernels, installed again when an engine selects
    it; an engine on another device (a GPU) gets the plain functions, not a CPU engine's compiled
    ones."""
    cpu = torch.device("cpu")
    f32 = qwen3.kernels.rms_norm
    assert compile_kernels(cpu, torch.bfloat16) and qwen3.kernels.rms_norm is not f32
    bf16 = qwen3.kernels.rms_norm
    assert compile_kernels(cpu, torch.float32) and qwen3.kernels.rms_norm is f32
    assert compile_kernels(cpu, torch.bfloat16) and qwen3.kernels.rms_norm is bf16
    select_kernels(torch.device("meta"), torch.bfloat16, enforce_eager=False)
    assert all(getattr(qwen3.kernels, name) is getattr(qwen3, name) for name in FUNCTIONS)


def test_compile_failure_falls_back_to_eager_with_a_warning(monkeypatch, caplog):
    use_eager_kernels()

    def broken(fn, **kwargs):
        def call(*args):
            raise RuntimeError("no C++ compiler found")
        return call

    monkeypatch.setattr(torch, "compile", broken)
    with caplog.at_level(logging.WARNING, logger="nanoqwen"):
        assert compile_kernels(torch.device("cpu"), torch.float32) is False
    assert "no C++ compiler found" in caplog.text and "enforce-eager" in caplog.text
    assert qwen3.kernels.rms_norm is qwen3.rms_norm
    monkeypatch.undo()
    use_eager_kernels()
    assert compile_kernels(torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("chosen", [None, "default", "/somewhere/else"])
def test_torch_compile_keeps_one_disk_cache_per_cpu_capability(chosen, monkeypatch):
    """A kernel cached under one ATEN_CPU_CAPABILITY gave NaN when reused under another, so the
    default torch.compile cache folder gets the capability appended; a folder the user chose stays."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from nanoqwen import compilation

    default = default_cache_dir()
    value = {None: None, "default": default}.get(chosen, chosen)
    if value is None:
        monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    else:
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", value)
    compilation._inductor_cache_per_cpu_capability()
    capability = torch.backends.cpu.get_cpu_capability().lower()
    expected = "/somewhere/else" if chosen == "/somewhere/else" else f"{default}-{capability}"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == expected


@pytest.mark.parametrize("gemv_max_rows", [0, 16])
def test_slow_bf16_cpus_run_the_elementwise_math_eager(gemv_max_rows, monkeypatch):
    """Where bf16 matmuls go through float32 (AVX2-only CPUs), inductor's bf16 code was several times
    slower than the plain ops: nothing is compiled, and bf16 calls of every size take the C++ functions
    where nanoqwen's kernels are on (the plain ones where they are off, and for other dtypes)."""
    from nanoqwen.ops import cpu, cpu_gemv

    before_path = cpu.matmul_path()
    before = {name: getattr(qwen3.kernels, name) for name in FUNCTIONS}
    monkeypatch.setattr(cpu, "select_matmul_path",
                        lambda: cpu.MatmulPath("float32", "test", gemv_max_rows=gemv_max_rows))
    monkeypatch.setattr(cpu_gemv, "available", lambda: True)
    calls = []
    monkeypatch.setattr(cpu_gemv, "swiglu", lambda x: calls.append(tuple(x.shape)) or qwen3.swiglu(x))
    try:
        line = select_kernels(torch.device("cpu"), torch.bfloat16, enforce_eager=False)
        assert "eager elementwise ops (faster than compiled ones where bf16 matmuls are slow)" in line
        for name in FUNCTIONS:  # nothing compiled
            assert not hasattr(getattr(qwen3.kernels, name), "compiled")
        if not gemv_max_rows:
            assert all(getattr(qwen3.kernels, name) is getattr(qwen3, name) for name in FUNCTIONS)
        with torch.inference_mode():
            qwen3.kernels.swiglu(torch.ones(2, 8, dtype=torch.bfloat16))
            qwen3.kernels.swiglu(torch.ones(MIN_COMPILED_TOKENS, 8, dtype=torch.bfloat16))
            qwen3.kernels.swiglu(torch.ones(2, 8))  # float32: the plain function
        assert calls == ([(2, 8), (MIN_COMPILED_TOKENS, 8)] if gemv_max_rows else [])
    finally:
        cpu.use_matmul_path(before_path)
        for name, fn in before.items():
            setattr(qwen3.kernels, name, fn)
