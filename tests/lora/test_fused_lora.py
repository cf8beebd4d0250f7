"""LoRA adapters on the fused CPU decoder (worker/fused_decoder.py): a decode step whose rows all use one adapter
runs in the one C++ call with that adapter's products, and computes what the model's per-module forward with the
adapter's hooks computes (nanoqwen/lora/layers.py): the same logits, the same greedy tokens, single- and multi-step.
Steps whose rows use different adapters (or some none) still take the per-module path."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS
from lora_testing import ALL_SEVEN, write_peft_adapter

from nanoqwen import LLM, LoRARequest, SamplingParams
from nanoqwen.attention.metadata import DecodeRow, PrefillRow
from nanoqwen.worker.model_runner import StepInput, one_lora_id

pytest.importorskip("peft")

TOKENS = 20
GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
# (id, LoraConfig fields): every projection, and q/v only (k, o, gate/up and down without an adapter)
ADAPTERS = {
    "all-seven": dict(r=8, lora_alpha=64, target_modules=ALL_SEVEN),
    "q-v": dict(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj"], use_rslora=True),
}


@pytest.fixture(scope="module")
def base(checkpoint):
    return checkpoint("tiny", dtype="bfloat16")


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    """Every adapter of ADAPTERS as a LoRARequest, written by PEFT."""
    root = tmp_path_factory.mktemp("fused-adapters")
    return {name: LoRARequest(name, i + 1, str(write_peft_adapter(base, root / name, 10 + i, **cfg)))
            for i, (name, cfg) in enumerate(ADAPTERS.items())}


def make_engine(base, **kwargs) -> LLM:
    """A bf16 CPU engine with LoRA on; skips where the fused decoder is not on (nothing to test there)."""
    llm = LLM(base, dtype="bfloat16", device="cpu", max_model_len=96, kv_cache_memory=8 << 20, block_size=4,
              enable_lora=True, max_lora_rank=8, **{"max_loras": 2, **kwargs})
    if llm.llm_engine.runner.fused_decoder is None:
        pytest.skip("the fused CPU decoder is not on here (bf16 kernels unavailable)")
    return llm


@pytest.fixture(scope="module")
def llm(base):
    return make_engine(base)


class FusedAdapterCalls:
    """Counts the adapters the fused decoder was given (LoRAManager.fused_decoder_weights' calls)."""

    def __init__(self, llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
        manager = llm.llm_engine.lora
        self.count, weights = 0, manager.fused_decoder_weights

        def counted(lora_id: int) -> object:
            self.count += 1
            return weights(lora_id)

        monkeypatch.setattr(manager, "fused_decoder_weights", counted)


def generate(llm: LLM, prompts: list[list[int]], loras: list, fused: bool = True) -> list[list[int]]:
    """Greedy tokens of each prompt under its adapter (None: the base model), through the fused decoder or not."""
    runner = llm.llm_engine.runner
    kept = runner.fused_decoder
    if not fused:
        runner.fused_decoder = None
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)]
    finally:
        runner.fused_decoder = kept


def test_one_lora_id():
    assert one_lora_id([]) == 0 and one_lora_id([0, 0]) == 0
    assert one_lora_id([3, 3, 3]) == 3
    assert one_lora_id([3, 0]) is None and one_lora_id([0, 3]) is None and one_lora_id([3, 4]) is None


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_fused_logits_equal_the_per_module_adapter_path(base, adapters, name, monkeypatch):
    """Decode steps of two rows on one adapter, run through the model runner: the fused decoder's float32 logits
    are the per-module path's, bit for bit (the same kernels in the same order), and not the base model's."""
    llm = make_engine(base, enable_prefix_caching=False)  # (its cache's blocks are written here directly)
    runner, manager = llm.llm_engine.runner, llm.llm_engine.lora
    lora_id = manager.add(adapters[name]).lora_id
    calls = FusedAdapterCalls(llm, monkeypatch)
    prompts = [PROMPTS[3], PROMPTS[1]]
    blocks = -(-(max(map(len, prompts)) + 8) // runner.kv_cache.block_size)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(len(prompts))]
    tokens = []
    for prompt, table in zip(prompts, tables, strict=True):
        prefill = StepInput(input_ids=prompt, decode=[], prefill=[PrefillRow(table, 0, len(prompt))],
                            sample_rows=[len(prompt) - 1], lora_ids=[lora_id] * len(prompt))
        tokens.append(int(runner.forward(prefill).argmax()))
    fused_decoder = runner.fused_decoder
    for i in range(6):
        rows = [DecodeRow(table, len(prompt) + 1 + i) for table, prompt in zip(tables, prompts, strict=True)]
        with_adapter = StepInput(input_ids=tokens, decode=rows, prefill=[], sample_rows=[0, 1],
                                 lora_ids=[lora_id, lora_id])
        before = calls.count
        fused = runner.forward(with_adapter)
        assert calls.count == before + 1  # (the fused decoder ran, with the adapter)
        base_logits = runner.forward(StepInput(input_ids=tokens, decode=rows, prefill=[], sample_rows=[0, 1]))
        runner.fused_decoder = None
        try:
            reference = runner.forward(with_adapter)  # (stores the step's keys and values again)
        finally:
            runner.fused_decoder = fused_decoder
        assert fused.dtype == torch.float32 and torch.equal(fused, reference), (i, (fused - reference).abs().max())
        assert not torch.allclose(fused, base_logits, atol=1e-2)
        tokens = reference.argmax(-1).tolist()


@pytest.mark.parametrize("num_scheduler_steps", [1, 4])
@pytest.mark.parametrize("name", list(ADAPTERS))
def test_fused_greedy_tokens_equal_the_per_module_path(base, adapters, name, num_scheduler_steps, monkeypatch):
    """Batch 1 and a batch of two on one adapter: the engine's tokens over TOKENS steps (one step a call, or
    num_scheduler_steps greedy steps in one C++ call) are the per-module path's, and the adapter changes them."""
    llm = make_engine(base, num_scheduler_steps=num_scheduler_steps)
    req = adapters[name]
    for prompts in ([PROMPTS[0]], [PROMPTS[0], PROMPTS[3]]):
        reference = generate(llm, prompts, [req] * len(prompts), fused=False)
        calls = FusedAdapterCalls(llm, monkeypatch)
        assert generate(llm, prompts, [req] * len(prompts)) == reference
        assert calls.count > 0
        monkeypatch.undo()
        assert generate(llm, prompts, [None] * len(prompts)) != reference


@pytest.mark.parametrize("num_scheduler_steps", [1, 4])
def test_mixed_batches_take_the_per_module_path(base, adapters, num_scheduler_steps, monkeypatch):
    """Rows with different adapters, or an adapter and none: the fused decoder is never given an adapter, and
    each row gets the tokens it gets alone."""
    llm = make_engine(base, num_scheduler_steps=num_scheduler_steps)
    a, b = adapters["all-seven"], adapters["q-v"]
    prompts = [PROMPTS[0], PROMPTS[1]]
    alone = [generate(llm, [prompts[0]], [a])[0], generate(llm, [prompts[1]], [b])[0],
             generate(llm, [prompts[1]], [None])[0]]
    calls = FusedAdapterCalls(llm, monkeypatch)
    assert generate(llm, prompts, [a, b]) == alone[:2]
    assert generate(llm, prompts, [a, None]) == [alone[0], alone[2]]
    assert calls.count == 0


def test_a_reloaded_slot_runs_its_new_adapter(base, adapters):
    """One slot: q/v only (its fused weights made), then every projection, then q/v again, each loaded over the
    last; the fused tokens are each adapter's per-module tokens (the slot's fused weights are made again for the
    adapter it now holds, not kept from the last one)."""
    llm = make_engine(base, max_loras=1)
    manager = llm.llm_engine.lora
    prompt = [PROMPTS[3]]
    reference = {name: generate(llm, prompt, [adapters[name]], fused=False) for name in ["all-seven", "q-v"]}
    assert reference["q-v"] != reference["all-seven"]
    loads = manager.slot_loads
    for name in ["q-v", "all-seven", "q-v"]:  # (q-v is in the slot already)
        assert generate(llm, prompt, [adapters[name]]) == reference[name], name
    assert manager.slot_loads == loads + 2
