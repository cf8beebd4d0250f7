"""The engine around the model: KV cache, batching, chunked prefill, queueing, streaming, abort."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, fresh_cache, prompt_logits

from nanoqwen import LLM, SamplingParams
from nanoqwen.attention.metadata import AttentionMetadata, DecodeRow, PrefillRow

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint("gqa2-untied", dtype="float32"), dtype="float32", device="cpu",
               max_model_len=256)


def test_kv_cache_decode_equals_full_recomputation(llm):
    model = llm.llm_engine.model
    tokens = list(PROMPTS[1])
    cache, tables = fresh_cache(model, 32, num_seqs=2, scatter=True)
    table = tables[1]  # blocks 1, 3, 5, ...: not consecutive, so they are gathered
    cpu = torch.device("cpu")
    with torch.inference_mode():
        meta = AttentionMetadata.build([], [PrefillRow(table, 0, len(tokens))], cache.block_size,
                                       cpu)
        hidden = model(torch.tensor(tokens), meta.positions, cache, meta)
        step_logits = [model.compute_logits(hidden[-1:])[0]]
        for _ in range(12):
            tokens.append(int(step_logits[-1].argmax()))
            meta = AttentionMetadata.build([DecodeRow(table, len(tokens))], [], cache.block_size,
                                           cpu)
            hidden = model(torch.tensor(tokens[-1:]), meta.positions, cache, meta)
            step_logits.append(model.compute_logits(hidden)[0])
    full = prompt_logits(model, tokens)  # the whole sequence recomputed without a cache
    n = len(PROMPTS[1])
    torch.testing.assert_close(torch.stack(step_logits), full[n - 1:], atol=1e-4, rtol=0)


@pytest.mark.parametrize("scatter", [False, True])
def test_cached_prefix_chunk_equals_full_prefill(llm, scatter):
    """A prompt split into chunks (the later ones attending to the cached earlier ones) gives the
    same logits."""
    model = llm.llm_engine.model
    tokens = PROMPTS[3]
    cache, tables = fresh_cache(model, 20, num_seqs=2, scatter=scatter)
    outs = []
    with torch.inference_mode():
        for start, end in [(0, 7), (7, 8), (8, 20)]:
            meta = AttentionMetadata.build([], [PrefillRow(tables[0], start, end - start)],
                                           cache.block_size, torch.device("cpu"))
            hidden = model(torch.tensor(tokens[start:end]), meta.positions, cache, meta)
            outs.append(model.compute_logits(hidden))
    torch.testing.assert_close(torch.cat(outs), prompt_logits(model, tokens), atol=1e-4, rtol=0)


def test_batched_decode_logits_equal_each_sequence_alone(llm):
    """Decode tokens of sequences with different context lengths in one batch (masking the
    shorter ones)."""
    model = llm.llm_engine.model
    cpu = torch.device("cpu")
    prompts = [PROMPTS[0], PROMPTS[3], PROMPTS[1]]  # 5, 20 and 13 tokens
    next_tokens = [11, 22, 33]
    for scatter in (False, True):
        cache, tables = fresh_cache(model, 24, num_seqs=3, scatter=scatter)
        with torch.inference_mode():
            prefill = [PrefillRow(t, 0, len(p)) for t, p in zip(tables, prompts, strict=True)]
            meta = AttentionMetadata.build([], prefill, cache.block_size, cpu)
            model(torch.tensor([t for p in prompts for t in p]), meta.positions, cache, meta)
            decode = [DecodeRow(t, len(p) + 1) for t, p in zip(tables, prompts, strict=True)]
            meta = AttentionMetadata.build(decode, [], cache.block_size, cpu)
            # 2 blocks alone; 6 and 4 blocks together, padded to 6
            assert len(meta.decode_groups) == 2
            # a lone sequence with consecutive blocks is read as a view; the others are gathered
            assert (meta.decode_groups[0].first_block is not None) == (not scatter)
            assert meta.decode_groups[1].block_tables is not None
            hidden = model(torch.tensor(next_tokens), meta.positions, cache, meta)
            batched = model.compute_logits(hidden)
        for i, p in enumerate(prompts):
            alone = prompt_logits(model, p + [next_tokens[i]])[-1]
            torch.testing.assert_close(batched[i], alone, atol=1e-4, rtol=0)


def test_batch_of_different_lengths_matches_each_prompt_alone(llm):
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in PROMPTS]
    together = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert together == alone
    # the prompts really produce different answers
    assert len({tuple(t) for t in alone}) == len(PROMPTS)


def test_chunked_prefill_and_queueing_give_the_same_tokens(checkpoint, llm):
    expected = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    small = LLM(checkpoint("gqa2-untied", dtype="float32"), dtype="float32", device="cpu",
                max_model_len=256, max_num_seqs=2, max_num_batched_tokens=3)
    assert [o.token_ids for o in small.generate(PROMPTS, GREEDY, use_tqdm=False)] == expected
    assert not small.llm_engine.has_unfinished_requests()
    block_manager = small.llm_engine.block_manager
    assert block_manager.num_free_blocks == block_manager.num_blocks


def test_mixed_prefill_and_decode_steps(llm):
    """A request added while another decodes shares its steps and still gets its own greedy
    tokens."""
    engine = llm.llm_engine
    expected = {i: llm.generate([p], GREEDY, use_tqdm=False)[0].token_ids
                for i, p in enumerate(PROMPTS[:2])}
    engine.add_request("a", PROMPTS[0], GREEDY)
    for _ in range(5):
        engine.step()
    engine.add_request("b", PROMPTS[1], GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert done == {"a": expected[0], "b": expected[1]}


def test_stop_token_and_finish_reasons(llm):
    first = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0]
    assert first.finish_reason == "length" and len(first.token_ids) == GREEDY.max_tokens
    stop_at = first.token_ids[5]
    k = first.token_ids.index(stop_at)
    out = llm.generate([PROMPTS[0]],
                       SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_at]),
                       use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.token_ids == first.token_ids[: k + 1]


def test_eos_from_generation_config_stops(llm):
    engine = llm.llm_engine
    assert engine.eos_token_ids == {151645, 151643}  # Qwen3-0.6B's generation_config.json lists two
    prompt = PROMPTS[0]
    first = llm.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids
    engine.eos_token_ids = frozenset({first[3]})  # (each request takes the engine's eos ids when it is added)
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24),
                           use_tqdm=False)[0]
        ignored = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    finally:
        engine.eos_token_ids = frozenset({151645, 151643})
    assert out.finish_reason == "stop" and out.token_ids == first[: first.index(first[3]) + 1]
    assert ignored.token_ids == first


def test_max_model_len_ends_generation(checkpoint):
    llm = LLM(checkpoint("gqa2-untied", dtype="float32"), dtype="float32", device="cpu",
              max_model_len=12)
    out = llm.generate([PROMPTS[0]],
                       SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.finish_reason == "length" and len(PROMPTS[0]) + len(out.token_ids) == 12


def test_seeded_sampling_is_reproducible_alone_or_in_batch(llm):
    params = SamplingParams(temperature=1.0, top_k=50, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0].token_ids
    batch = llm.generate(PROMPTS,
                         [GREEDY, params, SamplingParams(temperature=1.0, max_tokens=8), GREEDY],
                         use_tqdm=False)
    assert batch[1].token_ids == alone
    other = llm.generate([PROMPTS[1]], SamplingParams(temperature=1.0, top_k=50, max_tokens=16,
                                                      seed=99, ignore_eos=True),
                         use_tqdm=False)[0].token_ids
    assert other != alone


def test_stream_yields_text_deltas_and_abort_frees_the_blocks(llm):
    engine = llm.llm_engine
    deltas, final = [], None
    for delta, out in llm.stream(PROMPTS[0], GREEDY):
        deltas.append(delta)
        final = out
    assert final.finished and "".join(deltas) == final.text
    assert final.text == llm.get_tokenizer().decode(final.token_ids, skip_special_tokens=True)
    stream = llm.stream(PROMPTS[0], GREEDY)
    next(stream)
    stream.close()  # what a Ctrl-C or a dropped client does
    assert not engine.has_unfinished_requests() and not engine.requests
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_string_prompts_are_tokenized_without_template(llm):
    out = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=2),
                       use_tqdm=False)[0]
    assert (out.prompt_token_ids == llm.get_tokenizer().encode("Hello world")
            and out.prompt == "Hello world")


def test_vllm_prompt_dicts_are_taken_as_vllm_takes_them(llm):
    """vLLM's TextPrompt {"prompt": text} and TokensPrompt {"prompt_token_ids": ids} give what the text and
    the ids give, alone or in a list beside plain prompts (a dict is one prompt, not its keys)."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = llm.get_tokenizer().encode("Hello world")
    plain = llm.generate(["Hello world", ids], params, use_tqdm=False)
    one = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    mixed = llm.generate([{"prompt": "Hello world"}, {"prompt_token_ids": ids}, ids], params, use_tqdm=False)
    assert len(one) == 1 and len(mixed) == 3
    assert one[0].prompt_token_ids == ids and one[0].outputs[0].token_ids == plain[1].outputs[0].token_ids
    assert [o.prompt_token_ids for o in mixed] == [ids] * 3
    assert [o.outputs[0].token_ids for o in mixed] == [plain[0].outputs[0].token_ids] * 3
    assert mixed[0].prompt == "Hello world"
    streamed = list(llm.stream({"prompt_token_ids": ids}, params))
    assert streamed[-1][1].outputs[0].token_ids == plain[1].outputs[0].token_ids
