"""Checkpoints published already quantised (AWQ, GPTQ with and without act order, FP8): each format's tensors,
packed from known integers as its own tools lay them out, unpack to exactly those integers; the model computes
what transformers computes on the same weights dequantised; and the --quantization rules."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, hf_model, matrix_of, prompt_logits, rank_rows
from quantized_checkpoints import awq_tensors, gptq_tensors, write_quantized

from nanoqwen import LLM, ConfigError, SamplingParams
from nanoqwen.model_loader.loader import load_config, load_model
from nanoqwen.ops.hf_quants import unpack_awq, unpack_gptq
from nanoqwen.quantization import Int4Linear
from nanoqwen.quantization.fp8 import Fp8Linear
from nanoqwen.quantization.prequantized import CheckpointExperts, InputOrderLinear

SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
MOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=256, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])


@pytest.fixture(scope="module")
def quantized(checkpoint, tmp_path_factory):
    cache = {}

    def make(method: str, act_order: bool = False, moe: bool = False, symmetric: bool = False):
        key = (method, act_order, moe, symmetric)
        if key not in cache:
            src = checkpoint("tiny", dtype="float32", **SHAPE, **(MOE if moe else {}))
            cache[key] = write_quantized(src, tmp_path_factory.mktemp(f"{method}{int(act_order)}"), method, act_order,
                                         symmetric=symmetric)
        return cache[key]

    return make


def known(n: int = 48, k: int = 256, group: int = 128, seed: int = 0, lowest_zero: int = 0):
    """Integers q [n, k], zero points [n, k / group] and float16 scales (GPTQ's zeros stored minus one: 1..15)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    zero = torch.randint(lowest_zero, 16, (n, k // group), generator=g)
    scale = (torch.rand(n, k // group, generator=g) * 0.01 + 0.005).half()
    return q, zero, scale


def test_awq_unpacks_to_the_known_integers():
    q, zero, scale = known()
    t = awq_tensors(q, zero, scale)
    w = unpack_awq(t["qweight"], t["qzeros"], t["scales"], 128)
    assert torch.equal(w.q.long(), q)  # (AWQ's interleaved column order undone: a wrong order fails here)
    expected = (q - zero.repeat_interleave(128, 1)).float() * scale.float().repeat_interleave(128, 1)
    assert torch.equal(w.dequantize(), expected)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_unpacks_to_the_known_integers(act_order):
    q, zero, scale = known(seed=1, lowest_zero=1)
    k = q.shape[1]
    groups = torch.randperm(k, generator=torch.Generator().manual_seed(2)).argsort() // 128 if act_order \
        else torch.arange(k) // 128
    t = gptq_tensors(q, zero, scale, groups)
    w, order = unpack_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 128, zeros_minus_one=True)
    expected = (q - zero[:, groups]).float() * scale[:, groups].float()
    if act_order:
        assert order is not None and torch.equal(groups[order], torch.arange(k) // 128)
        assert torch.equal(w.dequantize(), expected[:, order])
    else:
        assert order is None and torch.equal(w.q.long(), q) and torch.equal(w.dequantize(), expected)


@pytest.mark.parametrize("method,act_order,symmetric", [("awq", False, False), ("gptq", False, False),
                                                        ("gptq", True, False), ("gptq", False, True),
                                                        ("fp8", False, False)],
                         ids=["awq", "gptq", "gptq-act-order", "gptq-sym", "fp8"])
def test_logits_equal_transformers_on_the_dequantised_weights(quantized, method, act_order, symmetric):
    """Symmetric GPTQ (every zero point 8) is held without offsets, with its float16 scales: 4.125 bits a weight."""
    path, reference, _ = quantized(method, act_order, symmetric=symmetric)
    model = load_model(path, load_config(path), torch.float32, torch.device("cpu"))
    qkv = model.layers[0].self_attn.qkv_proj
    kind = {"awq": Int4Linear, "gptq": InputOrderLinear if act_order else Int4Linear, "fp8": Fp8Linear}[method]
    assert isinstance(qkv, kind)
    if kind is Int4Linear:
        assert (qkv.offset is None) == symmetric and (qkv.scale.dtype == torch.float16) == symmetric
    with torch.no_grad():
        theirs = hf_model(reference, torch.float32)(torch.tensor([PROMPTS[1]])).logits[0]
    ours = prompt_logits(model, PROMPTS[1])
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)


def test_moe_awq_equals_transformers(quantized):
    """A Qwen3-MoE AWQ checkpoint: every expert's projections quantised, the router not."""
    path, reference, _ = quantized("awq", moe=True)
    model = load_model(path, load_config(path), torch.float32, torch.device("cpu"))
    experts = model.layers[0].mlp.experts
    assert model.config.is_moe and isinstance(experts, CheckpointExperts)
    assert all(isinstance(e, Int4Linear) for e in (*experts.gate_up_proj_experts, *experts.down_proj_experts))
    with torch.no_grad():
        theirs = hf_model(reference, torch.float32)(torch.tensor([PROMPTS[1]])).logits[0]
    torch.testing.assert_close(prompt_logits(model, PROMPTS[1]), theirs, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("method", ["awq", "fp8"])
def test_llm_generates_in_bf16(quantized, method, monkeypatch):
    """bf16 on CPU: AWQ through the int4 kernels (float32 scales, groups of 128), FP8 (one byte a weight) through
    fp8_gemv, both in the fused decode step, whose tokens equal the plain path's; `--quantization METHOD` with the
    checkpoint's own method changes nothing."""
    path, _, _ = quantized(method)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(path), max_model_len=128, kv_cache_memory=32 << 20)
    engine = llm.llm_engine
    tokens = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(tokens) == 12
    if method == "fp8":
        assert engine.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    assert engine.runner.fused_decoder is not None
    monkeypatch.setenv("NANOQWEN_FUSED_DECODE", "0")
    same = LLM(str(path), max_model_len=128, kv_cache_memory=32 << 20, quantization=method)
    assert same.llm_engine.runner.fused_decoder is None
    assert same.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].token_ids == tokens


def test_quantization_flag_rules(quantized, checkpoint):
    path, _, _ = quantized("awq")
    with pytest.raises(ConfigError, match=r"already quantized \(awq\): leave out --quantization int4"):
        LLM(str(path), quantization="int4", max_model_len=128, kv_cache_memory=32 << 20)
    plain = checkpoint("tiny", dtype="float32", **SHAPE)
    with pytest.raises(ConfigError, match="--quantization gptq: .* is not quantized with GPTQ"):
        LLM(str(plain), quantization="gptq", max_model_len=128, kv_cache_memory=32 << 20)


@pytest.mark.parametrize("method,moe", [("awq", False), ("gptq", False), ("fp8", False), ("awq", True)],
                         ids=["awq", "gptq", "fp8", "awq-moe"])
def test_tensor_parallel_ranks_hold_their_rows_and_columns(quantized, method, moe):
    """tensor_parallel_size 2: each rank holds its half of every quantised matrix, in the checkpoint's format: the
    output rows of each part of qkv_proj and gate_up_proj (each expert's gate and up), the input columns of o_proj
    and down_proj; what each rank's matrix computes is exactly that slice of the whole one."""
    path, _, _ = quantized(method, moe=moe)
    config = load_config(path)
    cpu = torch.device("cpu")
    whole = load_model(path, config, torch.float32, cpu)
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    for rank in range(2):
        shard = load_model(path, config, torch.float32, cpu, tp_rank=rank, tp_size=2)
        for full, part in zip(whole.layers, shard.layers, strict=True):
            cuts = {"self_attn.qkv_proj": lambda w: rank_rows(w, [q, kv, kv], rank),  # noqa: B023 (used at once)
                    "self_attn.o_proj": lambda w: w.chunk(2, 1)[rank]}  # noqa: B023
            experts = getattr(full.mlp, "experts", None)
            if isinstance(experts, CheckpointExperts):
                for e in range(experts.num_experts):
                    gate_up = matrix_of(experts, config.hidden_size, ("gate_up_proj", e))
                    inter = gate_up.shape[0] // 2
                    assert torch.equal(matrix_of(part.mlp.experts, config.hidden_size, ("gate_up_proj", e)),
                                       rank_rows(gate_up, [inter, inter], rank))
                    down = matrix_of(experts, inter, ("down_proj", e))
                    assert torch.equal(matrix_of(part.mlp.experts, inter // 2, ("down_proj", e)),
                                       down.chunk(2, 1)[rank])
            else:
                inter = full.mlp.gate_up_proj.out_features // 2
                cuts["mlp.gate_up_proj"] = lambda w: rank_rows(w, [inter, inter], rank)  # noqa: B023
                cuts["mlp.down_proj"] = lambda w: w.chunk(2, 1)[rank]  # noqa: B023
            for name, cut in cuts.items():
                a, b = full.get_submodule(name), part.get_submodule(name)
                assert isinstance(b, type(a)), name
                want = cut(matrix_of(a, a.in_features))
                assert torch.equal(matrix_of(b, want.shape[1]), want), (name, rank)
        o_proj = shard.layers[0].self_attn.o_proj
        assert isinstance(o_proj, {"awq": Int4Linear, "gptq": Int4Linear, "fp8": Fp8Linear}[method])
        assert o_proj.tp_size == 2


@pytest.mark.parametrize("method", ["awq", "fp8"])
def test_tensor_parallel_refuses_cuts_a_checkpoint_cannot_take(quantized, checkpoint, tmp_path, method):
    """No rank's cut may split a group of scales (AWQ/GPTQ's 128 inputs, FP8's blocks of 128), and GPTQ with act
    order cannot cut its row-parallel inputs at all (its groups run over all inputs in another order): each a
    ConfigError naming the tensor and the fix."""
    src = checkpoint("tiny", dtype="float32", **{**SHAPE, "intermediate_size": 384})  # 192 inputs a rank
    path, _, _ = write_quantized(src, tmp_path / method, method)
    config = load_config(path)
    load_model(path, config, torch.float32, torch.device("cpu"))  # whole: fine
    for rank in range(2):
        with pytest.raises(ConfigError, match=r"mlp.down_proj: tensor_parallel_size 2 cuts its 384 inputs into "
                                              r"192 a rank.*128.*use a tensor_parallel_size"):
            load_model(path, config, torch.float32, torch.device("cpu"), tp_rank=rank, tp_size=2)
    if method == "awq":
        path, _, _ = quantized("gptq", act_order=True)
        with pytest.raises(ConfigError, match=r"_proj: a GPTQ checkpoint with act order .* tensor_parallel_size 1"):
            load_model(path, load_config(path), torch.float32, torch.device("cpu"), tp_rank=0, tp_size=2)
