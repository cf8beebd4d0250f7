"""The per-CPU matmul path (nanoqwen/ops/cpu/matmul.py) and its choice (selection.py): how it is chosen, and
that both choices compute the same function: bf16 inputs, float32 accumulation, one rounding to bf16."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import hf_greedy, hf_model, our_greedy

from nanoqwen import LLM, SamplingParams
from nanoqwen.attention.backends.sdpa import prefill_attention_blocked
from nanoqwen.models.qwen3 import attention_reference
from nanoqwen.ops.cpu import build as cpu_build
from nanoqwen.ops.cpu import kernels as cpu_kernels
from nanoqwen.ops.cpu import matmul as cpu
from nanoqwen.ops.cpu import probes as cpu_probes
from nanoqwen.ops.cpu import selection
from nanoqwen.ops.quantize import quantize_weight
from nanoqwen.quantization.int8 import pick_kernel

# >= 64 rows: upcast and compiled kernels both run
LONG_PROMPT = [(7 * i + 3) % 5000 + 100 for i in range(80)]


@pytest.fixture(autouse=True)
def no_int4_amx_probe(monkeypatch):
    """select_matmul_path's int4 AMX-tile probe off (it measures this machine; tests/ops/cpu/test_amx.py tests it)."""
    monkeypatch.setenv("NANOQWEN_CPU_AMX", "0")


@pytest.mark.parametrize("forced", ["bf16", "float32"])
def test_the_environment_forces_either_path(forced, monkeypatch, tmp_path):
    monkeypatch.setenv("NANOQWEN_CPU_MATMUL", forced)
    monkeypatch.setenv("NANOQWEN_CPU_GEMV", "0")
    monkeypatch.setattr(selection, "probe", lambda: pytest.fail("a forced path must not measure"))
    choice = selection.select_matmul_path(tmp_path)
    assert choice.path == forced and "NANOQWEN_CPU_MATMUL" in choice.reason
    assert not (tmp_path / "cpu-matmul.json").exists()


@pytest.mark.parametrize("bf16_gflops, expected", [(1.0, "float32"), (60.0, "bf16")])
def test_auto_measures_once_and_caches_per_machine(bf16_gflops, expected, monkeypatch, tmp_path):
    monkeypatch.setenv("NANOQWEN_CPU_MATMUL", "auto")
    monkeypatch.setenv("NANOQWEN_CPU_GEMV", "0")
    calls = []

    def fake_timing(*args):  # bf16 at bf16_gflops, float32 at 63 GFLOP/s
        calls.append(args)
        return bf16_gflops if len(calls) % 2 else 63.0

    monkeypatch.setattr(cpu_probes, "matmul_gflops", fake_timing)
    first = selection.select_matmul_path(tmp_path)
    assert first.path == expected and len(calls) == 2
    assert first.bf16_gflops == bf16_gflops and first.float32_gflops == 63.0
    again = selection.select_matmul_path(tmp_path)  # from the cache: nothing measured
    assert again == first and len(calls) == 2
    cached = json.loads((tmp_path / "cpu-matmul.json").read_text())
    (key, value), = cached.items()
    assert "torch" in key and value["path"] == expected


# the alternative's GB/s at 1, 2, 4, 8, 16, 32, 64 rows: 15, 15, 15, 10, 8, 5, 5; nanoqwen's kernels take a
# row count while they reach 0.8 of that
@pytest.mark.parametrize("own_gb_s, expected_rows", [((37.0, 30.0, 20.0, 7.9, 5.0, 9.0, 9.0), 4),
                                                     ((11.9, 30.0, 20.0, 14.0, 9.0, 9.0, 9.0), 0),
                                                     ((37.0, 30.0, 12.0, 8.0, 6.4, 3.9, 9.0), 16),
                                                     ((37.0, 30.0, 12.0, 8.0, 6.4, 4.0, 3.0), 32),
                                                     ((37.0, 30.0, 12.0, 8.0, 6.4, 4.0, 4.0), 64)])
def test_gemv_kernels_are_chosen_by_measurement_once_per_machine(own_gb_s, expected_rows,
                                                                 monkeypatch, tmp_path):
    """Few rows go through nanoqwen's gemv kernels up to the row count where torch's F.linear
    clearly overtakes them (on a native-bf16 CPU too: it can at a few rows); measured once, then
    cached."""
    monkeypatch.setenv("NANOQWEN_CPU_MATMUL", "bf16")
    monkeypatch.setenv("NANOQWEN_CPU_GEMV", "auto")
    monkeypatch.setattr(cpu_kernels, "available", lambda: True)
    # (the extension itself may not be loaded in this process: the reason names its instructions)
    monkeypatch.setattr(cpu_kernels, "bf16_dot_instructions", lambda: "AVX2 FMA")
    torch_gb_s = (15.0, 15.0, 15.0, 10.0, 8.0, 5.0, 5.0)
    calls = []

    def probe(path, gemm):
        calls.append(path)
        assert not gemm  # (bf16_gemm: the float32 path's only)
        return dict(zip(cpu_probes.GEMV_PROBE_ROWS, zip(own_gb_s, torch_gb_s, strict=True), strict=True))

    monkeypatch.setattr(cpu_probes, "gemv_probe", probe)
    first = selection.select_matmul_path(tmp_path)
    assert first.path == "bf16" and calls == ["bf16"]
    assert first.gemv_max_rows == expected_rows and first.gemv == (expected_rows > 0)
    assert "1: 37.0 vs 15.0" in first.gemv_reason or expected_rows == 0
    assert (f"<= {expected_rows} rows: nanoqwen's gemv kernels" in first.describe()) == first.gemv
    again = selection.select_matmul_path(tmp_path)
    assert again == first and len(calls) == 1  # from the cache
    monkeypatch.setenv("NANOQWEN_CPU_GEMV", "1")
    forced = selection.select_matmul_path(tmp_path)
    assert forced.gemv and forced.gemv_max_rows == cpu.GEMV_MAX_ROWS and len(calls) == 1
    monkeypatch.setenv("NANOQWEN_CPU_GEMV", "0")
    assert not selection.select_matmul_path(tmp_path).gemv
    monkeypatch.setenv("NANOQWEN_CPU_GEMV", "auto")
    monkeypatch.setattr(cpu_build, "build_digest", lambda: "changed kernels")
    assert selection.select_matmul_path(tmp_path) == first and len(calls) == 2  # measured again


@pytest.mark.parametrize("path_name, gemv_max_rows, int8_rows", [
    ("bf16", 0, 0), ("bf16", 4, 64), ("bf16", 16, 64), ("bf16", 64, 64),
    ("float32", 4, 16), ("float32", 16, 16), ("float32", 64, 64)])
def test_int8_rows_take_the_own_kernel_up_to_64_on_bf16_else_16_or_the_bf16_limit(path_name, gemv_max_rows,
                                                                                  int8_rows):
    """With the gemv kernels on: on the bf16 path the int8 kernel takes up to GEMV_MAX_ROWS rows (the other
    way dequantises every matrix each step); on the float32 path up to 16 or the bf16 kernel's limit."""
    path = cpu.MatmulPath(path_name, "test", gemv_max_rows=gemv_max_rows)
    for rows in (1, 8, 16, 17, 64, 65):
        assert path.int8_gemv_rows(torch.ones(rows, 64, dtype=torch.bfloat16)) == (rows <= int8_rows)
    assert not path.int8_gemv_rows(torch.ones(8, 64, dtype=torch.float32))


@pytest.mark.parametrize("path, gemm", [("bf16", False), ("float32", False), ("float32", True)])
def test_gemv_probe_measures_both_kernels(path, gemm, monkeypatch):
    """The gemv kernel against what each row count takes without it: torch's F.linear, except from
    UPCAST_MIN_ROWS rows on the float32 path, where rows go through upcast_linear, or bf16_gemm where
    that was chosen."""
    if not cpu_kernels.available():
        pytest.skip("nanoqwen's CPU kernels cannot be built here")
    seen = {"upcast": [], "gemm": []}
    upcast, gemm_kernel = cpu.upcast_linear, cpu_kernels.bf16_gemm
    monkeypatch.setattr(cpu_probes, "upcast_linear", lambda x, w: seen["upcast"].append(x.shape[0]) or upcast(x, w))
    monkeypatch.setattr(cpu_kernels, "bf16_gemm", lambda x, w: seen["gemm"].append(x.shape[0]) or gemm_kernel(x, w))
    monkeypatch.setattr(cpu_probes, "GEMV_PROBE_SHAPE", (512, 256, 2))  # (small: this checks what runs, not speed)
    speeds = cpu_probes.gemv_probe(path, gemm)
    assert sorted(speeds) == list(cpu_probes.GEMV_PROBE_ROWS)
    # (rates of a tiny shape on a busy machine can round to 0.0 GB/s: what ran is checked, not how fast)
    assert all(math.isfinite(own) and math.isfinite(theirs) for own, theirs in speeds.values())
    expected = [m for m in cpu_probes.GEMV_PROBE_ROWS if m >= cpu.UPCAST_MIN_ROWS] if path == "float32" else []
    assert sorted(set(seen["gemm" if gemm else "upcast"])) == expected
    assert not seen["upcast" if gemm else "gemm"]


@pytest.mark.parametrize("own, expected", [(150.0, True), (100.0, False)])
def test_gemm_is_chosen_by_measurement_once_per_machine(own, expected, monkeypatch, tmp_path):
    """On the float32 path, rows past the gemv kernels' go through nanoqwen's bf16_gemm where it was
    measured faster than upcast_linear (120 GFLOP/s here); the gemv probe then measures against what was
    chosen. Measured once, cached; NANOQWEN_CPU_GEMV=1 forces it, =0 turns it off; the bf16 path never
    measures it."""
    monkeypatch.setenv("NANOQWEN_CPU_MATMUL", "float32")
    monkeypatch.setenv("NANOQWEN_CPU_GEMV", "auto")
    monkeypatch.setattr(cpu_kernels, "available", lambda: True)
    monkeypatch.setattr(cpu_kernels, "bf16_dot_instructions", lambda: "AVX2 FMA")
    calls = []
    monkeypatch.setattr(cpu_probes, "gemm_probe", lambda: calls.append("gemm") or {"own": own, "upcast": 120.0})
    monkeypatch.setattr(cpu_probes, "gemv_probe", lambda path, gemm: calls.append((path, gemm)) or
                        {m: (10.0, 1.0) for m in cpu_probes.GEMV_PROBE_ROWS})
    first = selection.select_matmul_path(tmp_path)
    assert first.gemm == expected and calls == ["gemm", ("float32", expected)]
    assert f"measured {own:.0f} vs 120 GFLOP/s" in first.gemm_reason
    assert ("nanoqwen's bf16_gemm" in first.describe()) == expected
    assert selection.select_matmul_path(tmp_path) == first and len(calls) == 2  # from the cache
    monkeypatch.setenv("NANOQWEN_CPU_GEMV", "1")
    assert selection.select_matmul_path(tmp_path).gemm and len(calls) == 2
    monkeypatch.setenv("NANOQWEN_CPU_GEMV", "0")
    assert not selection.select_matmul_path(tmp_path).gemm
    monkeypatch.setenv("NANOQWEN_CPU_GEMV", "auto")
    monkeypatch.setenv("NANOQWEN_CPU_MATMUL", "bf16")
    assert not selection.select_matmul_path(tmp_path).gemm and "gemm" not in calls[2:]


def test_linear_sends_many_bf16_rows_to_bf16_gemm_where_chosen(monkeypatch):
    """Few rows: the gemv kernel; more: bf16_gemm where chosen (the same function as upcast_linear), else
    upcast_linear; a bias or fp16 operands: upcast_linear."""
    if not cpu_kernels.available():
        pytest.skip("nanoqwen's CPU kernels cannot be built here")
    path = cpu.MatmulPath("float32", "test", gemv_max_rows=8, gemm=True)
    seen = []
    upcast, gemm_kernel = cpu.upcast_linear, cpu_kernels.bf16_gemm
    monkeypatch.setattr(cpu, "upcast_linear", lambda x, w, b=None: seen.append("upcast") or upcast(x, w, b))
    monkeypatch.setattr(cpu_kernels, "bf16_gemm", lambda x, w: seen.append("gemm") or gemm_kernel(x, w))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 64, generator=g).bfloat16()
    w, b = (torch.randn(48, 64, generator=g) * 0.1).bfloat16(), torch.randn(48, generator=g).bfloat16()
    got = path.linear(x, w)
    assert seen == ["gemm"]
    torch.testing.assert_close(got, upcast(x, w), atol=0.02, rtol=0.016)
    path.linear(x[:8], w)
    path.linear(x, w, b)
    path.linear(x.half(), w.half())
    assert seen == ["gemm", "upcast", "upcast"]
    cpu.MatmulPath("float32", "test", gemv_max_rows=8).linear(x, w)
    assert seen[-1] == "upcast"


def test_linear_leaves_tensors_off_the_cpu_to_torch():
    """A path with nanoqwen's kernels on sends tensors off the CPU (here on the meta device) to torch's
    F.linear, never to a CPU kernel."""
    path = cpu.MatmulPath("float32", "test", gemv_max_rows=8, gemm=True)
    w = torch.empty(48, 64, dtype=torch.bfloat16, device="meta")
    for rows in (4, 40):  # the gemv kernel's rows, the GEMM's
        y = path.linear(torch.empty(rows, 64, dtype=torch.bfloat16, device="meta"), w)
        assert y.device.type == "meta" and y.shape == (rows, 48) and y.dtype == torch.bfloat16


@pytest.mark.parametrize("bias", [False, True])
# odd sizes; 333 rows cut in blocks below
@pytest.mark.parametrize("shape", [(5, 64, 48), (17, 96, 333)])
def test_upcast_linear_is_the_float32_product_rounded_once(shape, bias, monkeypatch):
    rows, n_in, n_out = shape
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, n_in, generator=g).bfloat16()
    w = (torch.randn(n_out, n_in, generator=g) * 0.1).bfloat16()
    b = torch.randn(n_out, generator=g).bfloat16() if bias else None
    expected = F.linear(x.float(), w.float(), None if b is None else b.float()).bfloat16()
    # 50-row blocks: the blocked loop runs
    monkeypatch.setattr(cpu, "UPCAST_BLOCK_BYTES", 4 * n_in * 50)
    got = cpu.upcast_linear(x, w, b)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
    # and torch's own bf16 kernel computes the same up to the order of the float32 additions
    torch.testing.assert_close(got, F.linear(x, w, b), atol=0.05, rtol=0.016)


@pytest.mark.parametrize("num_cached", [0, 37])
def test_blocked_prefill_attention_is_the_same_on_both_paths(num_cached):
    g = torch.Generator().manual_seed(num_cached)
    t, hq, hkv, d = 150, 4, 2, 32  # two query blocks, the second one partial
    q = torch.randn(hq, t, d, generator=g).bfloat16()
    k = torch.randn(hkv, num_cached + t, d, generator=g).bfloat16()
    v = torch.randn(hkv, num_cached + t, d, generator=g).bfloat16()
    outs = {}
    for path in cpu.PATHS:
        upcast = cpu.MatmulPath(path, "test").upcast_16bit(q)
        assert upcast == (path == "float32")
        outs[path] = prefill_attention_blocked(q, k, v, num_cached, upcast=upcast)
    pos = torch.arange(num_cached, num_cached + t)[:, None]
    mask = (torch.arange(num_cached + t)[None, :] <= pos)[None, None]
    ref = attention_reference(q[None], k[None], v[None], mask)[0]
    for out in outs.values():
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, ref, atol=0.03, rtol=0.02)
    torch.testing.assert_close(outs["float32"], outs["bf16"], atol=0.02, rtol=0.02)


def test_int8_dequantise_path_in_float32_rounds_once():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 96, generator=g).bfloat16()
    q, scale = quantize_weight((torch.randn(70, 96, generator=g) * 0.05).bfloat16())
    got = pick_kernel(x, 96, cpu.MatmulPath("float32", "test"))(x, q, scale)
    assert torch.equal(got, (F.linear(x.float(), q.float()) * scale.float()).bfloat16())
    torch.testing.assert_close(got, pick_kernel(x, 96, cpu.MatmulPath("bf16", "test"))(x, q, scale),
                               atol=0.02, rtol=0.02)


def test_both_paths_give_transformers_greedy_tokens_in_bf16(checkpoint, monkeypatch):
    """The same bf16 checkpoint and an 80-token prompt (prefill through the upcast matmuls and the
    float32 attention products on the float32 path): the greedy tokens of both paths equal
    transformers' bf16 ones."""
    path = checkpoint("gqa2-untied", dtype="bfloat16")
    ref = hf_greedy(hf_model(path, torch.bfloat16), LONG_PROMPT, 12)
    for forced in cpu.PATHS:
        monkeypatch.setenv("NANOQWEN_CPU_MATMUL", forced)
        llm = LLM(path, dtype="bfloat16", device="cpu", max_model_len=128)
        assert forced in llm.llm_engine.kernel_path or forced == "bf16"
        assert llm.llm_engine.model.kernels.matmul.path == forced
        assert our_greedy(llm, LONG_PROMPT, 12) == ref, forced


def test_upcast_runs_only_for_many_rows(checkpoint, monkeypatch):
    """On the float32 path a prompt of more tokens than the gemv kernels take (at most GEMV_MAX_ROWS)
    goes through the float32 product (upcast_linear, or bf16_gemm where chosen), a decode row does not
    (it reads the bf16 weights directly)."""
    monkeypatch.setenv("NANOQWEN_CPU_MATMUL", "float32")
    rows = []
    original, gemm_kernel = cpu.upcast_linear, cpu_kernels.bf16_gemm
    monkeypatch.setattr(cpu, "upcast_linear",
                        lambda x, *a: rows.append(x.shape[0]) or original(x, *a))
    monkeypatch.setattr(cpu_kernels, "bf16_gemm", lambda x, w: rows.append(x.shape[0]) or gemm_kernel(x, w))
    llm = LLM(checkpoint("gqa2-untied", dtype="bfloat16"), dtype="bfloat16", device="cpu",
              max_model_len=128, enforce_eager=True)
    prompt = LONG_PROMPT[:cpu.GEMV_MAX_ROWS + 4]
    assert len(prompt) == cpu.GEMV_MAX_ROWS + 4 >= cpu.UPCAST_MIN_ROWS
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert rows and set(rows) == {len(prompt)}


@pytest.mark.parametrize("own_kernels", ["0", "1"])
def test_own_decode_kernels_give_transformers_greedy_tokens(own_kernels, checkpoint, monkeypatch):
    """nanoqwen's C++ decode step (gemv, RMSNorm, RoPE, SwiGLU, paged attention reading the cache in
    place; nanoqwen/ops/cpu/kernels.py) and torch's ops give transformers' bf16 greedy tokens, alone and for
    three sequences decoding together (rows of different lengths in one attention call). Forced on,
    the kernels take the prompts too: products through bf16_gemm, attention through prefill_attention."""
    if own_kernels == "1" and not cpu_kernels.available():
        pytest.skip("nanoqwen's CPU kernels cannot be built here")
    monkeypatch.setenv("NANOQWEN_CPU_MATMUL", "float32")
    monkeypatch.setenv("NANOQWEN_CPU_GEMV", own_kernels)
    path = checkpoint("gqa2-untied", dtype="bfloat16")
    prompts = [LONG_PROMPT[:n] for n in (7, 30, 80)]
    model = hf_model(path, torch.bfloat16)
    refs = [hf_greedy(model, p, 12) for p in prompts]
    prompt_attention = []
    if own_kernels == "1":
        original = cpu_kernels.prefill_attention
        monkeypatch.setattr(cpu_kernels, "prefill_attention",
                            lambda q, *a: prompt_attention.append(q.shape[0]) or original(q, *a))
    llm = LLM(path, dtype="bfloat16", device="cpu", max_model_len=128, block_size=16)
    runner = llm.llm_engine.runner
    assert runner.attention_backend == ("cpu" if own_kernels == "1" else None)
    assert ("C++" in llm.llm_engine.kernel_path) == (own_kernels == "1")
    # (forced on with them: the 80-token prompt's products go through bf16_gemm)
    assert ("nanoqwen's bf16_gemm" in llm.llm_engine.kernel_path) == (own_kernels == "1")
    assert [our_greedy(llm, p, 12) for p in prompts] == refs
    assert bool(prompt_attention) == (own_kernels == "1")
    together = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                            use_tqdm=False)
    assert [o.token_ids for o in together] == refs


def test_prompt_attention_goes_to_the_cpp_kernel_where_the_gemm_was_chosen():
    q = torch.zeros(3, 2, 8, dtype=torch.bfloat16)
    gemm = cpu.MatmulPath("float32", "test", gemm=True)
    assert gemm.own_gemm(q) and not gemm.own_gemm(q.float())
    assert not gemm.own_gemm(q.half())
    assert not cpu.MatmulPath("float32", "test").own_gemm(q)
    assert not cpu.MatmulPath("bf16", "test", gemm=True).own_gemm(q)


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_fused_decode_step_is_the_module_path_bit_for_bit(quantization, checkpoint, monkeypatch):
    """worker/fused_decoder.py runs each decoder layer in one C++ call with the same kernels in the same
    order as the modules: the same tokens and the same logprobs (to the last bit), for three
    sequences decoding together."""
    if not cpu_kernels.available():
        pytest.skip("nanoqwen's CPU kernels cannot be built here")
    monkeypatch.setenv("NANOQWEN_CPU_MATMUL", "float32")
    monkeypatch.setenv("NANOQWEN_CPU_GEMV", "1")
    path = checkpoint("gqa2-untied", dtype="bfloat16")
    prompts = [LONG_PROMPT[:n] for n in (5, 17, 30)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    outputs = {}
    for fused in ("0", "1"):
        monkeypatch.setenv("NANOQWEN_FUSED_DECODE", fused)
        llm = LLM(path, dtype="bfloat16", device="cpu", max_model_len=128,
                  quantization=quantization)
        runner = llm.llm_engine.runner
        assert (runner.fused_decoder is not None) == (fused == "1")
        calls = []
        if runner.fused_decoder is not None:
            original = runner.fused_decoder.__call__
            monkeypatch.setattr(type(runner.fused_decoder), "__call__",
                                lambda self, *a, seen=calls, run=original: seen.append(1) or run(*a))
        outputs[fused] = [(o.token_ids, repr(o.logprobs))
                          for o in llm.generate(prompts, params, use_tqdm=False)]
        assert bool(calls) == (fused == "1")
    assert outputs["1"] == outputs["0"]


def test_the_path_line_says_which_rows_each_kernel_takes():
    assert cpu.MatmulPath("float32", "test").describe().startswith(">= 16 rows: float32 compute")
    line = cpu.MatmulPath("float32", "test", gemv_max_rows=64, gemv_reason="r").describe()
    assert line.startswith("<= 64 rows: nanoqwen's gemv kernels (r); >= 65 rows: float32 compute")
    assert ">= 16 rows" in cpu.MatmulPath("float32", "test", gemv_max_rows=8, gemv_reason="r").describe()
    line = cpu.MatmulPath("float32", "test", gemv_max_rows=64, gemv_reason="r", gemm=True, gemm_reason="g").describe()
    assert line.endswith(">= 65 rows: float32 compute from 16-bit weights (nanoqwen's bf16_gemm, g; test)")
