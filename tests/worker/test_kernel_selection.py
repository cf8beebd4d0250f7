"""The kernels an engine chooses: torch.compile'd elementwise kernels compute what the plain functions in
models/qwen3.py compute, calls take them by size, and each engine keeps its own choice."""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import pytest
import torch

from nanoqwen import LLM, SamplingParams
from nanoqwen.models import qwen3
from nanoqwen.ops.cpu import kernels as cpu_kernels
from nanoqwen.ops.cpu.matmul import MatmulPath
from nanoqwen.worker import kernel_selection
from nanoqwen.worker.kernel_selection import (
    FUNCTIONS,
    MIN_COMPILED_TOKENS,
    CompiledBySize,
    compiled_functions,
    describe_kernels,
    select_kernels,
)

CPU = torch.device("cpu")


@pytest.fixture
def compiled():
    """A float32 CPU engine's kernels: the compiled functions for many tokens."""
    kernels = select_kernels(CPU, torch.float32, enforce_eager=False)
    assert isinstance(kernels.rms_norm, CompiledBySize)
    return kernels


def test_compiled_kernels_equal_the_reference_functions(compiled):
    assert compiled.rms_norm.compiled is not qwen3.rms_norm  # really compiled
    g = torch.Generator().manual_seed(0)
    functions = compiled_functions("cpu", torch.float32)
    # the small calls run eager; the compiled functions are tested directly too
    for n in (1, 5, MIN_COMPILED_TOKENS):
        kernels = functions if n < MIN_COMPILED_TOKENS else {name: getattr(compiled, name) for name in FUNCTIONS}
        for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
            x = torch.randn(n, 4, 32, generator=g).to(dtype)
            w = (torch.rand(32, generator=g) + 0.5).to(dtype)
            cos = torch.randn(n, 32, generator=g).to(dtype)
            sin = torch.randn(n, 32, generator=g).to(dtype)
            with torch.inference_mode():
                pairs = [(kernels["rms_norm"](x, w, 1e-6), qwen3.rms_norm(x, w, 1e-6)),
                         (kernels["rms_norm"](x.view(n, 128), w.repeat(4), 1e-6),
                          qwen3.rms_norm(x.view(n, 128), w.repeat(4), 1e-6)),
                         (kernels["apply_rope"](x, cos, sin), qwen3.apply_rope(x, cos, sin)),
                         (kernels["swiglu"](x.view(n, 128)), qwen3.swiglu(x.view(n, 128)))]
            for got, want in pairs:
                assert got.shape == want.shape and got.dtype == want.dtype
                torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_only_calls_on_many_tokens_take_the_compiled_kernel():
    calls = []
    swiglu = CompiledBySize(qwen3.swiglu, lambda x: calls.append(x.shape[0]) or qwen3.swiglu(x))
    with torch.inference_mode():
        for n in (1, 16, MIN_COMPILED_TOKENS - 1, MIN_COMPILED_TOKENS, 300):
            swiglu(torch.randn(n, 8))
    assert calls == [MIN_COMPILED_TOKENS, 300]


def test_engine_compiles_by_default_and_matches_enforce_eager(tiny_dir, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # an 83-token prefill step: the compiled kernels' range
    prompts = [list(range(1, 81)), [9, 8, 7]]
    kwargs = dict(dtype="float32", device="cpu", max_model_len=128)
    eager = LLM(tiny_dir, enforce_eager=True, **kwargs)
    assert eager.llm_engine.model.kernels.rms_norm is qwen3.rms_norm  # enforce_eager: the plain functions
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    compiled = LLM(tiny_dir, **kwargs)
    swiglu = compiled.llm_engine.model.kernels.swiglu
    assert isinstance(swiglu, CompiledBySize)
    assert eager.llm_engine.model.kernels.rms_norm is qwen3.rms_norm  # the first engine kept its own
    calls = []
    original = swiglu.compiled
    monkeypatch.setattr(swiglu, "compiled", lambda x: calls.append(x.shape[0]) or original(x))
    got = [o.outputs[0].token_ids for o in compiled.generate(prompts, params, use_tqdm=False)]
    assert got == want
    # the prefill went through the compiled kernel
    assert calls and min(calls) >= MIN_COMPILED_TOKENS


def test_kernels_follow_each_engines_choice(compiled, monkeypatch):
    """Each (device, dtype) has its compiled kernels, made once and shared by the engines that choose them;
    an engine on another device (a GPU) gets the plain functions and torch's matmuls, and nothing one engine
    chose changes another's. (bf16 on a CPU with fast bf16 matmuls, whatever this one has: an AVX2-only CPU's
    bf16 engines run eager, test_slow_bf16_cpus_run_the_elementwise_math_eager.)"""
    monkeypatch.setattr(kernel_selection, "select_matmul_path", lambda: MatmulPath("bf16", "test"))
    bf16 = select_kernels(CPU, torch.bfloat16, enforce_eager=False)
    assert bf16.rms_norm.compiled is not compiled.rms_norm.compiled
    again = select_kernels(CPU, torch.float32, enforce_eager=False)
    assert again.rms_norm.compiled is compiled.rms_norm.compiled
    gpu = select_kernels(torch.device("meta"), torch.bfloat16, enforce_eager=False)
    assert all(getattr(gpu, name) is getattr(qwen3, name) for name in FUNCTIONS)
    assert gpu.matmul == MatmulPath()
    assert isinstance(compiled.rms_norm, CompiledBySize) and isinstance(bf16.rms_norm, CompiledBySize)


def test_compile_failure_falls_back_to_eager_with_a_warning(monkeypatch, caplog):
    def broken(fn, **kwargs):
        def call(*args):
            raise RuntimeError("no C++ compiler found")
        return call

    compiled_functions.cache_clear()
    monkeypatch.setattr(torch, "compile", broken)
    try:
        with caplog.at_level(logging.WARNING, logger="nanoqwen"):
            kernels = select_kernels(CPU, torch.float32, enforce_eager=False)
        assert "no C++ compiler found" in caplog.text and "enforce-eager" in caplog.text
        assert kernels.rms_norm is qwen3.rms_norm
    finally:
        monkeypatch.undo()
        compiled_functions.cache_clear()
    assert isinstance(select_kernels(CPU, torch.float32, enforce_eager=False).rms_norm, CompiledBySize)


@pytest.mark.parametrize("chosen", [None, "default", "/somewhere/else"])
def test_torch_compile_keeps_one_disk_cache_per_cpu_capability(chosen, monkeypatch):
    """A kernel cached under one ATEN_CPU_CAPABILITY gave NaN when reused under another, so the
    default torch.compile cache folder gets the capability appended; a folder the user chose stays."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    default = default_cache_dir()
    value = {None: None, "default": default}.get(chosen, chosen)
    if value is None:
        monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    else:
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", value)
    kernel_selection._inductor_cache_per_cpu_capability()
    capability = torch.backends.cpu.get_cpu_capability().lower()
    expected = "/somewhere/else" if chosen == "/somewhere/else" else f"{default}-{capability}"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == expected


@pytest.mark.parametrize("gemv_max_rows", [0, 16])
def test_slow_bf16_cpus_run_the_elementwise_math_eager(gemv_max_rows, monkeypatch):
    """Where bf16 matmuls go through float32 (AVX2-only CPUs), inductor's bf16 code was several times
    slower than the plain ops: nothing is compiled, and bf16 calls of every size take the C++ functions
    where nanoqwen's kernels are on (the plain ones where they are off, and for other dtypes)."""
    monkeypatch.setattr(kernel_selection, "select_matmul_path",
                        lambda: MatmulPath("float32", "test", gemv_max_rows=gemv_max_rows))
    monkeypatch.setattr(cpu_kernels, "available", lambda: True)
    calls = []
    monkeypatch.setattr(cpu_kernels, "swiglu", lambda x: calls.append(tuple(x.shape)) or qwen3.swiglu(x))
    kernels = select_kernels(CPU, torch.bfloat16, enforce_eager=False)
    line = describe_kernels(kernels, CPU, torch.bfloat16)
    assert "eager elementwise ops (faster than compiled ones where bf16 matmuls are slow)" in line
    for name in FUNCTIONS:  # nothing compiled
        assert not isinstance(getattr(kernels, name), CompiledBySize)
    if not gemv_max_rows:
        assert all(getattr(kernels, name) is getattr(qwen3, name) for name in FUNCTIONS)
    with torch.inference_mode():
        kernels.swiglu(torch.ones(2, 8, dtype=torch.bfloat16))
        kernels.swiglu(torch.ones(MIN_COMPILED_TOKENS, 8, dtype=torch.bfloat16))
        kernels.swiglu(torch.ones(2, 8))  # float32: the plain function
    assert calls == ([(2, 8), (MIN_COMPILED_TOKENS, 8)] if gemv_max_rows else [])


def test_two_engines_in_one_process_keep_their_own_kernels(checkpoint, monkeypatch):
    """Two engines of one checkpoint with different kernel choices (the float32 matmul path with nanoqwen's
    own kernels on, and torch's bf16 kernels with them off), built and run in one process, interleaved: each
    gives exactly the logprobs it gives alone, and the two differ (so a choice leaking from one engine to the
    other would show)."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    prompts = [list(range(3, 40)), [5, 6, 7]]
    choices = {"float32": {"NANOQWEN_CPU_MATMUL": "float32", "NANOQWEN_CPU_GEMV": "1"},
               "bf16": {"NANOQWEN_CPU_MATMUL": "bf16", "NANOQWEN_CPU_GEMV": "0"}}

    def build(name: str) -> LLM:
        for key, value in choices[name].items():
            monkeypatch.setenv(key, value)
        return LLM(checkpoint("tiny", dtype="bfloat16"), dtype="bfloat16", device="cpu", max_model_len=128,
                   enforce_eager=True)

    def run(llm: LLM) -> list:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [[sorted((token, lp.logprob) for token, lp in step.items()) for step in o.outputs[0].logprobs]
                for o in outs]

    alone = {}
    for name in choices:
        llm = build(name)
        alone[name] = run(llm)
        del llm
    assert alone["float32"] != alone["bf16"]
    engines = {name: build(name) for name in choices}
    paths = {name: llm.llm_engine.model.kernels.matmul for name, llm in engines.items()}
    assert paths["float32"].path == "float32" and paths["float32"].gemv
    assert paths["bf16"] == replace(paths["bf16"], path="bf16", gemv_max_rows=0)
    for _ in range(2):
        for name, llm in engines.items():
            assert run(llm) == alone[name], name
