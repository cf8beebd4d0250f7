"""LoRA adapters (nanoqwen/lora/) compute what PEFT's PeftModel computes, alone and in mixed batches, through
the engine's scheduling (prefix cache, preemption, chunked prefill, n > 1, structured outputs)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import PROMPTS, hf_greedy, make_llm, prompt_logits
from lora_testing import ALL_SEVEN, peft_model, write_peft_adapter
from safetensors.torch import load_file, save_file

from nanoqwen import LLM, LoRARequest, SamplingParams
from nanoqwen.errors import ConfigError, InvalidRequestError

pytest.importorskip("peft")

PROMPT = [9707, 11, 847, 829, 374, 1207, 16948, 13, 358, 1075, 311, 3270]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

# (id, LoraConfig fields): ranks, target sets (short names, a regex), rsLoRA, rank/alpha patterns, layers
ADAPTERS = {
    "r4-all-seven": dict(r=4, lora_alpha=8, target_modules=ALL_SEVEN),
    "r8-qv-rslora": dict(r=8, lora_alpha=5, target_modules=["q_proj", "v_proj"], use_rslora=True),
    "r2-regex-o-down": dict(r=2, lora_alpha=3, target_modules=r".*\.(o_proj|down_proj)"),
    "patterns-layer0": dict(r=4, lora_alpha=7, target_modules=ALL_SEVEN, rank_pattern={"q_proj": 8, "down_proj": 2},
                            alpha_pattern={"gate_proj": 11}, layers_to_transform=[0]),
}


@pytest.fixture(scope="module")
def base(checkpoint):
    return checkpoint("tiny", dtype="float32")


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    """Every adapter of ADAPTERS, written by PEFT, by id."""
    root = tmp_path_factory.mktemp("adapters")
    return {name: write_peft_adapter(base, root / name, seed, **cfg)
            for seed, (name, cfg) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def llm(base):
    return make_llm(base, enable_lora=True, max_loras=3, max_lora_rank=8)


def request(adapters, name: str) -> LoRARequest:
    return LoRARequest(name, list(ADAPTERS).index(name) + 1, str(adapters[name]))


def adapter_logits(llm, req: LoRARequest, prompt: list[int]) -> torch.Tensor:
    """nanoqwen's float32 logits [T, V] of one prompt under an adapter, through the model's hooks."""
    lora = llm.llm_engine.lora
    lora.prepare([lora.add(req).lora_id] * len(prompt))
    try:
        return prompt_logits(llm.llm_engine.model, prompt)
    finally:
        lora.clear()


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_logits_and_greedy_tokens_match_peft(llm, base, adapters, name):
    ref = peft_model(base, adapters[name])
    with torch.inference_mode():
        expected = ref(torch.tensor([PROMPT])).logits[0].float()
        with ref.disable_adapter():
            base_logits = ref(torch.tensor([PROMPT])).logits[0].float()
    req = request(adapters, name)
    got = adapter_logits(llm, req, PROMPT)
    assert (expected - base_logits).abs().max() > 0.05  # the adapter changes the logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    out = llm.generate([PROMPT], GREEDY, use_tqdm=False, lora_request=req)[0]
    assert out.outputs[0].token_ids == hf_greedy(ref, PROMPT, GREEDY.max_tokens)


def test_rank_pattern_and_alpha_pattern_are_read(adapters, base):
    from nanoqwen.lora.peft import load_peft_adapter
    from nanoqwen.model_loader.loader import load_config

    adapter = load_peft_adapter(adapters["patterns-layer0"], load_config(base))
    assert {layer for layer, _ in adapter.weights} == {0}  # layers_to_transform
    assert adapter.weights[(0, "q_proj")].lora_a.shape[0] == 8
    assert adapter.weights[(0, "down_proj")].scaling == 7 / 2
    assert adapter.weights[(0, "gate_proj")].scaling == 11 / 4
    assert adapter.weights[(0, "k_proj")].scaling == 7 / 4
    rslora = load_peft_adapter(adapters["r8-qv-rslora"], load_config(base))
    assert rslora.weights[(1, "v_proj")].scaling == pytest.approx(5 / 8**0.5)


def test_mixed_batch_gives_each_sequence_its_tokens_alone(llm, adapters):
    """Three adapters and the base in one batch, both with the batched matmuls and the per-group reference."""
    names = ["r4-all-seven", "r8-qv-rslora", "patterns-layer0"]
    reqs = [request(adapters, n) for n in names] + [None]
    prompts = PROMPTS
    alone = [llm.generate([p], GREEDY, use_tqdm=False, lora_request=r)[0].outputs[0].token_ids
             for p, r in zip(prompts, reqs, strict=True)]
    assert len({tuple(t) for t in alone}) == 4
    mixed = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=reqs)
    assert [o.outputs[0].token_ids for o in mixed] == alone
    # the same prompt under each: the adapters differ from each other and from the base
    same = llm.generate([PROMPT] * 4, GREEDY, use_tqdm=False, lora_request=reqs)
    assert len({tuple(o.outputs[0].token_ids) for o in same}) == 4


def test_batched_path_matches_the_reference_loop(llm, adapters):
    lora = llm.llm_engine.lora
    ids = [lora.add(request(adapters, n)).lora_id for n in ["r4-all-seven", "r2-regex-o-down"]]
    rows = [ids[0]] * 4 + [0] * 3 + [ids[1]] * 5  # one prompt of 12 tokens, rows of mixed adapters
    results = []
    for reference in (True, False):
        lora.reference = reference
        lora.prepare(rows)
        try:
            results.append(prompt_logits(llm.llm_engine.model, PROMPT))
        finally:
            lora.clear()
            lora.reference = False
    torch.testing.assert_close(results[1], results[0], atol=1e-5, rtol=0)
    assert llm.llm_engine.lora.step.active is False


def test_merged_weights_give_the_same_tokens(base, adapters, tmp_path):
    ref = peft_model(base, adapters["r4-all-seven"])
    merged = tmp_path / "merged"
    ref.merge_and_unload().save_pretrained(merged)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (base / name).is_file():
            (merged / name).write_bytes((base / name).read_bytes())
    merged_llm = make_llm(merged)
    lora_llm = make_llm(base, enable_lora=True, max_lora_rank=8)
    want = merged_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    got = lora_llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=request(adapters, "r4-all-seven"))
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_prefix_cache_never_shares_kv_between_adapters(base, adapters):
    long_prompt = PROMPTS[3] + PROMPTS[1]  # several full 4-token blocks
    a, b = request(adapters, "r4-all-seven"), request(adapters, "r8-qv-rslora")
    fresh = make_llm(base, enable_lora=True, max_lora_rank=8)
    expected = fresh.generate([long_prompt], GREEDY, use_tqdm=False, lora_request=b)[0].outputs[0].token_ids
    llm = make_llm(base, enable_lora=True, max_lora_rank=8)
    bm = llm.llm_engine.block_manager
    llm.generate([long_prompt], GREEDY, use_tqdm=False)  # the base model's blocks are cached
    llm.generate([long_prompt], GREEDY, use_tqdm=False, lora_request=a)  # then adapter a's
    hits = bm.prefix_hits
    assert llm.generate([long_prompt], GREEDY, use_tqdm=False, lora_request=b)[0].outputs[0].token_ids == expected
    assert bm.prefix_hits == hits  # no block of the base's nor a's was reused under b
    llm.generate([long_prompt], GREEDY, use_tqdm=False, lora_request=b)
    assert bm.prefix_hits > hits  # b's own blocks are


def test_one_slot_evicts_the_least_recently_used_idle_adapter(base, adapters, llm):
    names = ["r4-all-seven", "r8-qv-rslora", "r2-regex-o-down"]
    expected = [llm.generate([PROMPT], GREEDY, use_tqdm=False, lora_request=request(adapters, n))[0]
                .outputs[0].token_ids for n in names]
    one = make_llm(base, enable_lora=True, max_loras=1, max_lora_rank=8)
    reqs = [request(adapters, n) for n in names]
    # all at once: one slot, so the scheduler runs one adapter's requests at a time
    got = one.generate([PROMPT] * 3, GREEDY, use_tqdm=False, lora_request=reqs)
    assert [o.outputs[0].token_ids for o in got] == expected
    lora = one.llm_engine.lora
    assert lora.slot_loads == 3 and len(lora.slots) == 1
    assert list(lora.slots) == [lora.registry[3].lora_id]  # the last one used holds the slot


def test_preemption_chunked_prefill_and_n_with_adapters(base, adapters, llm):
    req = request(adapters, "r8-qv-rslora")
    long_prompt = PROMPTS[3] * 2
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = llm.generate([long_prompt], params, use_tqdm=False, lora_request=req)[0].outputs[0].token_ids
    chunked = make_llm(base, enable_lora=True, max_lora_rank=8, max_num_batched_tokens=8)
    got = chunked.generate([long_prompt], params, use_tqdm=False, lora_request=req)[0]
    assert got.outputs[0].token_ids == expected
    # a cache of 26 blocks of 4 tokens for 3 sequences of 64: someone is preempted and recomputed
    small = make_llm(base, enable_lora=True, max_lora_rank=8, max_model_len=72, kv_cache_memory=_kv_bytes(base, 26))
    outs = small.generate([long_prompt] * 3, params, use_tqdm=False, lora_request=req)
    assert small.llm_engine.scheduler.num_preemptions > 0
    assert all(o.outputs[0].token_ids == expected for o in outs)
    n2 = llm.generate([long_prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2),
                      use_tqdm=False, lora_request=req)[0]
    assert [c.token_ids for c in n2.outputs] == [expected, expected]


def _kv_bytes(base, num_blocks: int, block_size: int = 4) -> int:
    """The KV-cache budget of num_blocks float32 blocks of the tiny model."""
    c = json.loads((base / "config.json").read_text())
    return num_blocks * 2 * c["num_hidden_layers"] * block_size * c["num_key_value_heads"] * c["head_dim"] * 4


def test_structured_outputs_with_an_adapter(llm, adapters):
    from nanoqwen.sampling_params import StructuredOutputsParams

    params = SamplingParams(temperature=0, max_tokens=20,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    out = llm.generate([PROMPT], params, use_tqdm=False, lora_request=request(adapters, "r4-all-seven"))[0]
    assert out.outputs[0].text in ("yes", "no")


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_base_with_an_adapter(checkpoint, tmp_path, quantization):
    base = checkpoint("tiny", dtype="bfloat16")
    adapter = write_peft_adapter(base, tmp_path / "a", 7, r=8, lora_alpha=64, target_modules=ALL_SEVEN)
    req = LoRARequest("a", 1, str(adapter))
    with torch.inference_mode():
        ref = peft_model(base, adapter)
        expected = ref(torch.tensor([PROMPT])).logits[0].float()
        with ref.disable_adapter():
            base_logits = ref(torch.tensor([PROMPT])).logits[0].float()
    llm = LLM(base, dtype="bfloat16", device="cpu", max_model_len=64, kv_cache_memory=8 << 20,
              quantization=quantization, enable_lora=True, max_lora_rank=8)
    got = adapter_logits(llm, req, PROMPT)
    plain = prompt_logits(llm.llm_engine.model, PROMPT)
    lora_error = (got - expected).abs().mean()
    assert lora_error < (plain - expected).abs().mean() / 4  # the adapter's change is there
    assert lora_error < (base_logits - expected).abs().mean() / 2  # and not lost in the quantisation
    assert llm.generate([PROMPT], GREEDY, use_tqdm=False, lora_request=req)[0].outputs[0].token_ids


def _rewrite(adapter, tmp_path, config=None, tensors=None):
    """A copy of adapter's folder with config fields and tensors changed."""
    out = tmp_path / "changed"
    out.mkdir()
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**cfg, **(config or {})}))
    weights = load_file(adapter / "adapter_model.safetensors")
    save_file({**weights, **(tensors or {})}, out / "adapter_model.safetensors")
    return out


@pytest.mark.parametrize("change, field", [
    (dict(config={"modules_to_save": ["lm_head"]}), "modules_to_save"),
    (dict(config={"target_modules": ["q_proj", "embed_tokens"]}), "embed_tokens"),
    (dict(config={"use_dora": True}), "use_dora"),
    (dict(config={"bias": "all"}), "bias"),
    (dict(tensors={"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 10)}), "embedding"),
    (dict(tensors={"base_model.model.lm_head.weight": torch.zeros(4, 10)}), "LM-head"),
])
def test_unsupported_adapters_are_refused_naming_the_field(llm, adapters, tmp_path, change, field):
    folder = _rewrite(adapters["r4-all-seven"], tmp_path, **change)
    with pytest.raises(InvalidRequestError, match=field):
        llm.llm_engine.add_lora(LoRARequest("bad", 99, str(folder)))
    assert 99 not in llm.llm_engine.list_loras()


def test_bad_requests_and_options_are_refused(base, adapters, llm):
    with pytest.raises(InvalidRequestError, match="max_lora_rank"):
        make_llm(base, enable_lora=True, max_lora_rank=4).generate(
            [PROMPT], GREEDY, use_tqdm=False, lora_request=request(adapters, "r8-qv-rslora"))
    with pytest.raises(InvalidRequestError, match="enable_lora"):
        make_llm(base).generate([PROMPT], GREEDY, use_tqdm=False, lora_request=request(adapters, "r4-all-seven"))
    with pytest.raises(ConfigError, match="speculative"):
        make_llm(base, enable_lora=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(InvalidRequestError, match="lora_request"):
        llm.generate([PROMPT, PROMPT], GREEDY, use_tqdm=False, lora_request=[None])
    with pytest.raises(InvalidRequestError, match="lora_int_id"):
        LoRARequest("x", 0, "/nowhere")
    llm.llm_engine.add_lora(request(adapters, "r4-all-seven"))
    with pytest.raises(InvalidRequestError, match="lora_int_id 1 is already"):
        llm.llm_engine.add_lora(LoRARequest("other-name", 1, str(adapters["r2-regex-o-down"])))


def test_add_remove_and_stream(base, adapters):
    llm = make_llm(base, enable_lora=True, max_lora_rank=8)
    engine = llm.llm_engine
    req = request(adapters, "r2-regex-o-down")
    assert engine.add_lora(req) and engine.list_loras() == {req.lora_int_id}
    want = llm.generate([PROMPT], GREEDY, use_tqdm=False, lora_request=req)[0].outputs[0].token_ids
    streamed = [out for _, out in llm.stream(PROMPT, GREEDY, lora_request=req)]
    assert streamed[-1].outputs[0].token_ids == want
    assert engine.remove_lora(req.lora_int_id) and engine.list_loras() == set()
    assert not engine.remove_lora(req.lora_int_id)


def test_moe_base_with_attention_adapters_matches_peft(tmp_path):
    from nanoqwen.model_loader.init_random import preset_config, write_random_model

    base = write_random_model(tmp_path / "moe", preset_config("qwen3-moe-tiny"), dtype="float32", std=0.08)
    adapter = write_peft_adapter(base, tmp_path / "a", 3, r=4, lora_alpha=8,
                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    ref = peft_model(base, adapter)
    with torch.inference_mode():
        expected = ref(torch.tensor([PROMPT])).logits[0].float()
    llm = make_llm(base, enable_lora=True)
    torch.testing.assert_close(adapter_logits(llm, LoRARequest("a", 1, str(adapter)), PROMPT), expected,
                               atol=1e-4, rtol=0)
    # an expert's adapter is refused, naming the layer
    weights = load_file(adapter / "adapter_model.safetensors")
    name = "base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_A.weight"
    folder = _rewrite(adapter, tmp_path, tensors={name: torch.zeros(4, 64)})
    assert name not in weights
    with pytest.raises(InvalidRequestError, match="experts"):
        llm.llm_engine.add_lora(LoRARequest("b", 2, str(folder)))


def test_command_line_flags():
    import argparse

    from nanoqwen.entrypoints.engine_args import add_engine_args, engine_config_from_args
    from nanoqwen.entrypoints.server.run import add_serve_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    add_serve_args(p)
    args = p.parse_args(["--enable-lora", "--max-loras", "3", "--max-lora-rank", "32",
                         "--lora-modules", "sql=/a/sql", "poet=/a/poet"])
    config = engine_config_from_args(args)
    assert (config.enable_lora, config.max_loras, config.max_lora_rank) == (True, 3, 32)
    assert args.lora_modules == [("sql", "/a/sql"), ("poet", "/a/poet")]
    assert engine_config_from_args(p.parse_args([])).enable_lora is False
    with pytest.raises(SystemExit):
        p.parse_args(["--lora-modules", "no-equals-sign"])


def test_the_scheduler_runs_at_most_max_loras_adapters_at_once():
    from nanoqwen.core.block_manager import BlockManager
    from nanoqwen.core.scheduler import Scheduler
    from nanoqwen.core.sequence import Sequence

    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64, max_loras=2)
    seqs = [Sequence(f"r{i}", 0, [1, 2, 3], GREEDY, lora_id=lora_id) for i, lora_id in enumerate([1, 0, 2, 1, 3, 0])]
    for seq in seqs:
        scheduler.add(seq)
    batch = scheduler.schedule()
    # adapters 1 and 2 fill both slots: adapter 3's request waits (and, first in line, the ones after it)
    assert [p.seq.request_id for p in batch.prefill] == ["r0", "r1", "r2", "r3"]
    scheduler.finish(seqs[2])  # adapter 2 is done: adapter 3 may run
    assert {"r4", "r5"} <= {p.seq.request_id for p in scheduler.schedule().prefill}


def test_multi_step_decoding_with_adapters(base, adapters, llm):
    reqs = [request(adapters, "r4-all-seven"), None, request(adapters, "r8-qv-rslora")]
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False, lora_request=reqs)]
    multi = make_llm(base, enable_lora=True, max_loras=2, max_lora_rank=8, num_scheduler_steps=4)
    got = multi.generate(PROMPTS[:3], GREEDY, use_tqdm=False, lora_request=reqs)
    assert [o.outputs[0].token_ids for o in got] == expected


@pytest.mark.parametrize("num_scheduler_steps", [1, 4])
def test_mixed_adapter_steps_leave_the_fused_cpu_decoder(checkpoint, tmp_path, num_scheduler_steps):
    """bf16 on a CPU with nanoqwen's kernels: the fused C++ decoder computes one adapter for all rows (or none), so
    a step with an adapter row and a base row takes the per-module path and gets the adapter's tokens (steps on one
    adapter: test_fused_lora.py)."""
    base = checkpoint("tiny", dtype="bfloat16")
    adapter = write_peft_adapter(base, tmp_path / "a", 5, r=8, lora_alpha=64, target_modules=ALL_SEVEN)
    req = LoRARequest("a", 1, str(adapter))
    llm = LLM(base, dtype="bfloat16", device="cpu", max_model_len=64, kv_cache_memory=8 << 20, enable_lora=True,
              max_lora_rank=8, num_scheduler_steps=num_scheduler_steps)
    runner = llm.llm_engine.runner
    if runner.fused_decoder is None:
        pytest.skip("the fused CPU decoder is not on here (no fast path to leave)")
    prompts = [PROMPTS[0], PROMPTS[1]]
    mixed = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[req, None])]
    fused, runner.fused_decoder = runner.fused_decoder, None
    try:
        reference = [o.outputs[0].token_ids
                     for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[req, None])]
        base_alone = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        runner.fused_decoder = fused
    assert mixed == reference and mixed[0] != base_alone


def test_cli_lora_flag_answers_with_the_adapter(base, adapters, llm):
    """`nanoqwen generate --lora PATH` (llama.cpp's flag): --enable-lora and the adapter's rank come with it, and
    the answer is LLM.generate's with that adapter (not the base model's)."""
    from conftest import run_cli

    name = "r4-all-seven"
    params = SamplingParams(temperature=0, max_tokens=6)
    text = "Hello there"
    expected = llm.generate([text], params, lora_request=request(adapters, name), use_tqdm=False)[0].outputs[0].text
    base_text = llm.generate([text], params, use_tqdm=False)[0].outputs[0].text
    assert expected != base_text
    r = run_cli("generate", "--model", str(base), "--dtype", "float32", "--lora", str(adapters[name]),
                "--prompt", text, "--no-chat-template", "--temperature", "0", "--max-tokens", "6",
                "--kv-cache-memory", "8MiB", "--max-model-len", "128", "--block-size", "4", "-q")
    assert r.returncode == 0, r.stderr
    assert r.stdout == expected + "\n"
    bad = run_cli("generate", "--model", str(base), "--lora", str(base), "--prompt", "x", "-q")
    assert bad.returncode == 1 and "no adapter_config.json" in bad.stderr
