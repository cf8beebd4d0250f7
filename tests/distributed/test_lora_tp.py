"""LoRA adapters under tensor parallelism (CPU, gloo, a real worker process): each rank holds its shard of every
adapter, cut as the base layer is (nanoqwen/lora/layers.py), and rank 0's slot table reaches the worker with the
steps (nanoqwen/lora/manager.py, LoRASync). So TP=2 gives TP=1's tokens and logprobs for adapters on all seven
projections, alone and in mixed batches, for adapters loaded after the engine started, through slot evictions and
an adapter removed and another loaded under its id."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import PROMPTS, make_llm

from nanoqwen import LoRARequest, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lora"))  # (lora_testing, beside the LoRA tests)
from lora_testing import ALL_SEVEN, write_peft_adapter  # noqa: E402

pytest.importorskip("peft")
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow, pytest.mark.tensor_parallel,
              pytest.mark.usefixtures("one_thread_per_rank")]

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=2)
# (LoraConfig fields): all seven projections, ranks 4 and 8 (a rank below the slots' max pads with zeros), one
# with its own rank on the row-parallel down_proj, an rsLoRA one
ADAPTERS = {
    "a": dict(r=4, lora_alpha=8, target_modules=ALL_SEVEN),
    "b": dict(r=8, lora_alpha=5, target_modules=ALL_SEVEN, rank_pattern={"down_proj": 2}),
    "c": dict(r=8, lora_alpha=6, target_modules=ALL_SEVEN, use_rslora=True),
}
OPTIONS = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "enforce_eager": True}



@pytest.fixture(scope="module")
def base(checkpoint):
    return checkpoint("tiny", dtype="float32")


@pytest.fixture(scope="module")
def requests(base, tmp_path_factory) -> dict[str, LoRARequest]:
    """A LoRARequest of each of ADAPTERS (random A and B, written by PEFT), by name."""
    root = tmp_path_factory.mktemp("tp-adapters")
    return {name: LoRARequest(name, i + 1, str(write_peft_adapter(base, root / name, 10 + i, **cfg)))
            for i, (name, cfg) in enumerate(ADAPTERS.items())}


def run(llm, prompts: list[list[int]], reqs: list[LoRARequest | None]) -> list[tuple[list[int], list[dict]]]:
    """Each prompt's greedy tokens, and the top-2 logprobs of its prompt's positions and of its tokens, in one
    batch."""
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=reqs)
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in e.items()}
                                      for e in o.prompt_logprobs[1:] + o.outputs[0].logprobs])
            for o in outs]


def assert_same(got, expected) -> None:
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, expected, strict=True):
        assert tokens == ref_tokens
        for mine, theirs in zip(logprobs, ref_logprobs, strict=True):
            assert mine.keys() == theirs.keys() and mine
            for token, logprob in mine.items():
                assert logprob == pytest.approx(theirs[token], abs=1e-4)


def test_tp2_runs_adapters_as_tp1(base, requests):
    a, b, c = requests["a"], requests["b"], requests["c"]
    mixed = [a, b, None, a]
    ref = make_llm(base, **OPTIONS)
    try:
        alone = {name: run(ref, [PROMPTS[0]], [req])[0] for name, req in [("a", a), ("b", b), ("c", c),
                                                                          ("base", None)]}
        mixed_ref = [run(ref, [p], [r])[0] for p, r in zip(PROMPTS, mixed, strict=True)]
    finally:
        ref.llm_engine.shutdown()
    # each adapter changes the tokens: a rank without its shard (or with another's) would show
    assert len({tuple(tokens) for tokens, _ in alone.values()}) == 4
    assert len({tuple(tokens) for tokens, _ in mixed_ref}) == 4

    llm = make_llm(base, tensor_parallel_size=2, **OPTIONS)
    try:
        engine = llm.llm_engine
        assert engine.list_loras() == set()
        engine.add_lora(a)  # loaded after the start: the worker gets it with the first step that uses it
        assert_same(run(llm, [PROMPTS[0]], [a]), [alone["a"]])
        # a mixed batch (b new to the worker); the base model's row adds nothing
        assert_same(run(llm, PROMPTS, mixed), mixed_ref)
        # both slots are taken: c evicts the least recently used one on every rank alike, and a comes back
        assert_same(run(llm, [PROMPTS[0], PROMPTS[0]], [c, b]), [alone["c"], alone["b"]])
        assert_same(run(llm, [PROMPTS[0]], [a]), [alone["a"]])
        assert engine.runner.lora.slot_loads == 4  # a, b, then c in place of a, a in place of b
        # removed, and another adapter loaded under its id: every rank runs the new one
        assert engine.remove_lora(a.lora_int_id)
        again = LoRARequest("c-again", a.lora_int_id, c.lora_path)
        assert_same(run(llm, [PROMPTS[0]], [again]), [alone["c"]])
        assert_same(run(llm, [PROMPTS[0]], [None]), [alone["base"]])
    finally:
        llm.llm_engine.shutdown()
