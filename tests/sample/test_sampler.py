"""Sampling filters, penalties, min_tokens and logprobs, each checked on known numbers:
ignoring one would fail."""

from __future__ import annotations

import math

import pytest
import torch

from nanoqwen import InvalidRequestError, SamplingParams
from nanoqwen.sample.penalties import apply_penalties
from nanoqwen.sample.sampler import (
    ARGMAX_BLOCK,
    SamplerOutput,
    argmax,
    exponential_noise,
    exponential_race_reference,
    filter_probs,
    race_uniform,
    sample,
    top_p_threshold,
    top_p_threshold_reference,
)

# probabilities 0.4, 0.3, 0.15, 0.1, 0.05 over tokens 0..4, in shuffled token order
PROBS = torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15])
LOGITS = PROBS.log()[None, :]
GREEDY = SamplingParams(temperature=0)


def kept(params: SamplingParams) -> dict[int, float]:
    probs, ids = filter_probs(LOGITS.clone(), [params])
    return {int(i): round(float(p), 4) for p, i in zip(probs[0], ids[0], strict=True) if p > 0}


def run(logits: torch.Tensor, params: list[SamplingParams],
        generators: list[torch.Generator | None] | None = None,
        prompts: list[list[int]] | None = None, outputs: list[list[int]] | None = None,
        stops: list[set[int]] | None = None) -> SamplerOutput:
    b = len(params)
    return sample(logits, params, generators or [None] * b, prompts or [[]] * b,
                  outputs or [[]] * b, stops or [set()] * b)


def tokens(logits: torch.Tensor, params: list[SamplingParams], **kw) -> list[int]:
    return run(logits, params, **kw).token_ids.tolist()


# --- filters --------------------------------------------------------------------------------------

def test_no_filter_keeps_the_distribution():
    assert kept(SamplingParams()) == {0: 0.1, 1: 0.4, 2: 0.05, 3: 0.3, 4: 0.15}


def test_top_k_keeps_the_k_most_likely():
    assert kept(SamplingParams(top_k=2)) == {1: round(0.4 / 0.7, 4), 3: round(0.3 / 0.7, 4)}


def test_top_p_keeps_the_smallest_set_reaching_p():
    assert set(kept(SamplingParams(top_p=0.7))) == {1, 3}  # 0.4 + 0.3 reaches 0.7
    assert set(kept(SamplingParams(top_p=0.71))) == {1, 3, 4}
    assert set(kept(SamplingParams(top_p=0.01))) == {1}  # the most likely token always stays


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    assert set(kept(SamplingParams(min_p=0.3))) == {1, 3, 4}  # threshold 0.12
    assert set(kept(SamplingParams(min_p=0.2))) == {0, 1, 3, 4}  # threshold 0.08


def test_temperature_sharpens_and_flattens():
    cold, hot = kept(SamplingParams(temperature=0.5)), kept(SamplingParams(temperature=2.0))
    expected_cold = {i: p**2 for i, p in enumerate(PROBS.tolist())}
    total = sum(expected_cold.values())
    assert cold[1] == pytest.approx(expected_cold[1] / total, abs=1e-3)
    assert hot[1] < 0.4 < cold[1]


def test_filters_apply_per_row_in_a_mixed_batch():
    logits = LOGITS.repeat(3, 1)
    probs, ids = filter_probs(logits, [SamplingParams(top_k=1), SamplingParams(),
                                       SamplingParams(top_p=0.7)])
    support = [{int(i) for p, i in zip(probs[r], ids[r], strict=True) if p > 0} for r in range(3)]
    assert support == [{1}, {0, 1, 2, 3, 4}, {1, 3}]


def test_top_k_1_equals_greedy_and_temperature_0_is_argmax():
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(top_k=1, temperature=1.5)] * 2 + [GREEDY] * 2
    out = run(logits, params)
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 4  # nobody asked for logprobs


@pytest.mark.parametrize("path", ["kernel", "blocks"])
def test_cpu_argmax_is_torch_argmax_on_ties_nan_and_inf(path, monkeypatch):
    """sampler.argmax's CPU paths (nanoqwen's C++ argmax where its kernels are loaded; else block
    maxima, then the first block holding the row's max) give torch.argmax's index: the first of
    tied maxima, across and inside blocks, a NaN as the largest, an all -inf row's 0; rows of any
    length (the kernel's 8 lanes and its tail; the blocks' multiple of 128, else torch.argmax)."""
    from nanoqwen.ops.cpu import kernels as cpu_kernels

    if path == "kernel" and not cpu_kernels.available():
        pytest.skip("nanoqwen's CPU kernels cannot be built here")
    if path == "blocks":
        monkeypatch.setattr(cpu_kernels, "loaded", lambda: False)
    used = []
    monkeypatch.setattr(cpu_kernels, "argmax", lambda v, run=cpu_kernels.argmax: used.append(1) or run(v))
    vocab = 12 * ARGMAX_BLOCK
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(13, vocab, generator=g)
    rows[1, [300, 5, 900]] = 50.0  # tied maxima in three blocks: the first index is 5
    rows[2, [260, 261]] = 50.0  # tied inside one block
    rows[3, 700], rows[3, 1000] = float("nan"), float("nan")  # the first NaN wins
    rows[4] = float("-inf")
    rows[5, 3], rows[5, 1200] = float("inf"), float("inf")
    rows[6, ARGMAX_BLOCK - 1] = 50.0  # the last value of a block
    rows[7, -1] = 50.0  # the last value of the row
    rows[8] = 1.0  # all equal: 0
    rows[9, 2 * ARGMAX_BLOCK] = rows[9].max()  # ties a value of the row's first max
    rows[10, vocab - 3] = 50.0  # in the last 7 values (the kernel's tail when V is cut by one)
    rows[11, vocab - 4] = float("nan")  # a NaN in that tail
    rows[12, [vocab - 9, vocab - 2]] = 50.0  # tied between the last full 8 lanes and that tail
    expected = rows.argmax(-1)
    assert expected[:3].tolist() != [0, 0, 0]  # the cases above are not trivially 0
    assert torch.equal(argmax(rows), expected)
    assert torch.equal(argmax(rows[:, ::2]), rows[:, ::2].argmax(-1))  # strided (a copy), V/2 still blocks
    assert torch.equal(argmax(rows.bfloat16()), rows.bfloat16().argmax(-1))
    odd = rows[:, :vocab - 1]  # V not a multiple of the block or of 8 lanes
    assert torch.equal(argmax(odd), odd.argmax(-1))
    assert torch.equal(argmax(rows[:, :5]), rows[:, :5].argmax(-1))  # shorter than 8 lanes
    assert argmax(torch.empty(0, vocab)).shape == (0,)
    assert bool(used) == (path == "kernel")


def test_cpp_argmax_of_bf16_values_is_torch_argmax():
    """The C++ argmax reads bf16 rows too (the greedy multi-step decode takes the LM head's bf16 output,
    worker/fused_decoder.py): torch.argmax's index of the same bf16 values, on rows full of ties (bf16 rounds
    many random values to the same one), NaN, -inf, and lengths cut in the 8 lanes' tail."""
    from nanoqwen.ops.cpu import kernels as cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("nanoqwen's CPU kernels cannot be built here")
    g = torch.Generator().manual_seed(1)
    rows = (torch.randn(6, 1001, generator=g) * 4).round().bfloat16()  # values -16..16: ties everywhere
    rows[1, [17, 999]] = 100.0  # tied, the first in the lanes, the second in the tail
    rows[2, 1000] = float("nan")  # a NaN, last
    rows[3] = float("-inf")
    rows[4, -1] = 100.0
    for width in (1001, 1000, 8, 7):
        values = rows[:, :width].contiguous()
        assert torch.equal(cpu_kernels.argmax(values), values.argmax(-1)), width
        assert torch.equal(cpu_kernels.argmax(values), cpu_kernels.argmax(values.float()))


def test_samples_follow_the_distribution():
    n = 4000
    gen = torch.Generator().manual_seed(0)
    draws = run(LOGITS.repeat(n, 1), [SamplingParams()] * n, [gen] * n).token_ids
    freq = torch.bincount(draws, minlength=5).float() / n
    # each frequency within 4 standard errors of its probability
    for p, f in zip(PROBS.tolist(), freq.tolist(), strict=True):
        assert abs(f - p) < 4 * math.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("params", [SamplingParams(top_k=3), SamplingParams(top_p=0.8)])
def test_filtered_samples_follow_the_renormalised_distribution(params):
    """top_k rows draw over their k candidates only; the result must still be exact."""
    n = 4000
    gen = torch.Generator().manual_seed(1)
    draws = run(LOGITS.repeat(n, 1), [params] * n, [gen] * n).token_ids
    freq = torch.bincount(draws, minlength=5).float() / n
    kept = {1: 0.4, 3: 0.3, 4: 0.15}  # the three most likely, for both filters
    for token in range(5):
        p = kept.get(token, 0.0) / sum(kept.values())
        bound = 4 * math.sqrt(p * (1 - p) / n) + 1e-9
        assert abs(freq[token].item() - p) < bound, (token, freq.tolist())


def test_sample_does_not_modify_the_logits():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    params = [SamplingParams(repetition_penalty=1.5, presence_penalty=1.0, min_tokens=5), GREEDY,
              SamplingParams(frequency_penalty=0.5, logprobs=3)]
    run(logits, params, prompts=[[1, 2]] * 3, outputs=[[3, 4]] * 3, stops=[{0}] * 3)
    assert torch.equal(logits, before)


# --- penalties ------------------------------------------------------------------------------------

def test_penalties_flip_the_greedy_argmax():
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0]])
    assert tokens(logits, [GREEDY], outputs=[[0]]) == [0]
    assert tokens(logits, [SamplingParams(temperature=0, presence_penalty=1.5)],
                  outputs=[[0]]) == [1]
    assert tokens(logits, [SamplingParams(temperature=0, frequency_penalty=0.6)],
                  outputs=[[0, 0]]) == [1]
    assert tokens(logits, [SamplingParams(temperature=0, repetition_penalty=1.5)],
                  prompts=[[0]]) == [1]
    # presence/frequency look at the output only, so a prompt token is not penalised by them
    assert tokens(logits, [SamplingParams(temperature=0, presence_penalty=2.0)],
                  prompts=[[0]]) == [0]


def test_penalties_apply_only_to_rows_that_ask_for_them():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(repetition_penalty=1.7), SamplingParams(),
              SamplingParams(frequency_penalty=1.0), SamplingParams(temperature=0)]
    prompts, outputs = [[1, 2, 3]] * 4, [[4, 5, 5]] * 4
    out = apply_penalties(logits, params, prompts, outputs)
    assert torch.equal(out[1], logits[1]) and torch.equal(out[3], logits[3])
    assert not torch.equal(out[0], logits[0]) and not torch.equal(out[2], logits[2])
    # each penalised row counts its own tokens: row 2's output is [4, 5, 5], so only 4 and 5 move
    moved = (out[2] != logits[2]).nonzero().flatten().tolist()
    assert moved == [4, 5] and (logits[2, 5] - out[2, 5]).item() == pytest.approx(2.0)
    # through sample: the same argmax token flips in the penalised greedy row only
    logits = torch.tensor([[5.0, 4.0, 0.0]]).repeat(2, 1)
    params = [SamplingParams(temperature=0, presence_penalty=2.0), GREEDY]
    assert tokens(logits, params, outputs=[[0], [0]]) == [1, 0]


# --- min_tokens -----------------------------------------------------------------------------------

def test_min_tokens_blocks_stop_ids_until_reached():
    logits = torch.tensor([[1.0, 2.0, 9.0, 8.0, 3.0]])  # stop ids 2 and 3 are the most likely
    params = [SamplingParams(temperature=0, min_tokens=3)]
    # 2 outputs < 3: both blocked
    assert tokens(logits, params, outputs=[[0, 0]], stops=[{2, 3}]) == [4]
    assert tokens(logits, params, outputs=[[0, 0, 0]], stops=[{2, 3}]) == [2]  # reached: free again
    # only the row's own stop ids
    assert tokens(logits, params, outputs=[[0, 0]], stops=[{2}]) == [3]
    # min_tokens 0 blocks nothing
    assert tokens(logits, [GREEDY], outputs=[[]], stops=[{2, 3}]) == [2]


def test_min_tokens_blocks_sampled_rows_too_and_only_its_rows():
    n = 500
    logits = torch.tensor([[0.0, 0.0, 3.0]]).repeat(n, 1)  # token 2 (the stop) is ~90% likely
    params = [SamplingParams(min_tokens=1)] * (n - 1) + [SamplingParams()]
    gen = torch.Generator().manual_seed(0)
    # 99 >= V: skipped
    draws = tokens(logits, params, generators=[gen] * n, outputs=[[]] * n, stops=[{2, 99}] * n)
    assert 2 not in draws[:-1]
    draws = tokens(logits[:200], [SamplingParams()] * 200, generators=[gen] * 200,
                   stops=[{2}] * 200)
    assert draws.count(2) > 150


def test_min_tokens_yields_to_a_grammar_that_allows_only_a_stop():
    """A row whose allowed tokens (its grammar's bitmask: the rest at -inf) are only stop ids ends
    there even short of min_tokens: blocking them would leave nothing to sample (a fuzzed
    request with an empty guided_regex and min_tokens once sampled a token outside its grammar).
    Other rows keep min_tokens."""
    inf = float("-inf")
    logits = torch.tensor([[inf, inf, 1.0, inf], [0.5, inf, 2.0, inf]])  # row 0: only the stop 2
    for params in ([SamplingParams(temperature=0, min_tokens=5)] * 2, [SamplingParams(min_tokens=5)] * 2):
        gen = torch.Generator().manual_seed(0)
        assert tokens(logits, params, generators=[gen, gen], outputs=[[], []], stops=[{2}, {2}]) == [2, 0]


# --- logprobs -------------------------------------------------------------------------------------

def test_logprobs_of_the_chosen_token_ranks_and_top():
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(3)) * 3
    params = [SamplingParams(temperature=0, logprobs=5), SamplingParams(logprobs=20),
              SamplingParams(), SamplingParams(temperature=0.7, top_k=50, logprobs=0)]
    gens = [None, torch.Generator().manual_seed(1), None, torch.Generator().manual_seed(2)]
    out = run(logits, params, generators=gens)
    exact = logits.double().log_softmax(-1)
    assert out.logprobs[2] is None
    for i in (0, 1, 3):
        lp = out.logprobs[i]
        assert lp is not None and lp.token_id == out.token_ids[i].item()
        assert lp.logprob == pytest.approx(exact[i, lp.token_id].item(), abs=1e-5)
        assert lp.rank == 1 + int((exact[i] > exact[i, lp.token_id]).sum())
        n = params[i].logprobs
        assert len(lp.top) == n
        top_ids = exact[i].topk(n).indices.tolist() if n else []
        assert [t for t, _ in lp.top] == top_ids
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        for t, v in lp.top:
            assert v == pytest.approx(exact[i, t].item(), abs=1e-5)
        assert sum(math.exp(v) for _, v in lp.top) <= 1 + 1e-6
    # greedy
    assert out.logprobs[0].rank == 1 and out.logprobs[0].top[0][0] == out.logprobs[0].token_id
    assert out.logprobs[3].top == []  # logprobs=0: only the chosen token


def test_logprobs_are_raw_before_penalties_and_temperature():
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0]])
    params = SamplingParams(temperature=0, presence_penalty=2.0, repetition_penalty=1.5,
                            min_tokens=2, logprobs=2)
    out = run(logits, [params], prompts=[[3]], outputs=[[0]], stops=[{2}])
    exact = logits.double().log_softmax(-1)[0]
    lp = out.logprobs[0]
    # the penalty chose token 1; raw, token 0 is still ahead
    assert lp.token_id == 1 and lp.rank == 2
    assert lp.logprob == pytest.approx(exact[1].item(), abs=1e-5)
    assert [t for t, _ in lp.top] == [0, 1]
    hot = run(logits, [SamplingParams(temperature=5.0, top_k=1, logprobs=1)],
              [torch.Generator().manual_seed(0)])
    # not divided by the temperature
    assert hot.logprobs[0].logprob == pytest.approx(exact[0].item(), abs=1e-5)


def test_top_p_and_top_k_keep_tied_values_together():
    """A cut keeps every token tied with the last one kept (transformers' top_k does the same), so a row's
    kept set does not depend on how a sort orders its ties."""
    logits = torch.tensor([[0.3, 0.3, 0.2, 0.2]]).log()
    support = {0, 1}
    probs, ids = filter_probs(logits, [SamplingParams(top_p=0.1)])
    assert {int(i) for p, i in zip(probs[0], ids[0], strict=True) if p > 0} == support
    probs, ids = filter_probs(logits, [SamplingParams(top_p=0.61)])  # 0.6 above the 0.2s: both stay
    assert {int(i) for p, i in zip(probs[0], ids[0], strict=True) if p > 0} == {0, 1, 2, 3}
    probs, ids = filter_probs(logits, [SamplingParams(top_k=3)])  # the third is tied with the fourth
    assert {int(i) for p, i in zip(probs[0], ids[0], strict=True) if p > 0} == {0, 1, 2, 3}


def test_top_k_rows_keep_the_same_candidates_alone_or_beside_whole_vocabulary_rows():
    """A batch whose rows all have a top_k keeps only the k best columns (token order); beside a row
    without one every row keeps the vocabulary: each row's distribution over tokens is the same."""
    logits = torch.randn(3, 200, generator=torch.Generator().manual_seed(3))
    logits[1, [7, 150]] = logits[1].max() + 1  # a tie at the second best
    params = [SamplingParams(top_k=5, top_p=0.8), SamplingParams(top_k=2, min_p=0.1), SamplingParams()]
    dense_all = torch.zeros(3, 200)
    probs, ids = filter_probs(logits, params)
    assert ids.shape[1] == 200
    dense_all.scatter_(1, ids, probs)
    probs, ids = filter_probs(logits[:2], params[:2])
    assert ids.shape[1] == 5 and bool((ids.diff(dim=-1) > 0).all())  # the 5 best, in token order
    compact = torch.zeros(2, 200).scatter_(1, ids, probs)
    torch.testing.assert_close(compact, dense_all[:2])
    assert (compact[1] > 0).sum() == 2 and compact[1, 7] == compact[1, 150]
    allowed = torch.full((2, 5000), float("-inf"))
    allowed[:, [10, 20]] = torch.tensor([1.0, 2.0])  # a grammar allowing 2 tokens, top_k 20: no tie to follow
    probs, ids = filter_probs(allowed, [SamplingParams(top_k=20)] * 2)
    assert ids.shape[1] == 20 and {int(i) for p, i in zip(probs[0], ids[0], strict=True) if p > 0} == {10, 20}
    tied = torch.tensor([[5.0, 4.0, 3.0, 3.0, 3.0, 1.0, 0.0, -1.0, -2.0, -3.0]])  # a tie past the 3 best
    probs, ids = filter_probs(tied, [SamplingParams(top_k=3)])
    assert ids.shape[1] == 6 and {int(i) for p, i in zip(probs[0], ids[0], strict=True) if p > 0} == {0, 1, 2, 3, 4}


def test_top_p_threshold_kernel_is_the_sorting_reference():
    """The radix select gives the reference's threshold on rows of any length, ties (values rounded to
    bf16), zeros, a row holding a NaN and a row of zeros."""
    from nanoqwen.ops.cpu import kernels as cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("nanoqwen's CPU kernels cannot be built here")
    g = torch.Generator().manual_seed(5)
    for vocab in (1, 7, 100, 3000, 151936):
        rows = torch.randn(8, vocab, generator=g).mul(torch.tensor([0.1, 1, 3, 10] * 2)[:, None]).softmax(-1)
        rows[1] = rows[1].bfloat16().float()  # many ties
        rows[2, : vocab // 2] = 0.0
        rows[3, 0] = float("nan")
        rows[4] = 0.0
        top_p = torch.tensor([0.9, 0.5, 0.95, 0.9, 0.9, 1e-6, 0.999, 0.3])
        expected = top_p_threshold_reference(rows, top_p)
        torch.testing.assert_close(cpu_kernels.top_p_threshold(rows, top_p), expected, equal_nan=True,
                                   rtol=0, atol=0)
        assert top_p_threshold(rows, top_p).isnan().tolist() == [False, False, False, True] + [False] * 4
    exact = torch.tensor([[0.5, 0.25, 0.25, 0.0]] * 3)  # sums exact in binary: the cut at equality
    for threshold in (top_p_threshold_reference, cpu_kernels.top_p_threshold):
        assert threshold(exact, torch.tensor([0.5, 0.4999, 0.75])).tolist() == [0.25, 0.5, 0.25]


def test_exponential_noise_is_splitmix64_of_key_and_token():
    """The tensor version (int64 arithmetic that wraps) against splitmix64 written with Python's integers."""
    mask = (1 << 64) - 1

    def splitmix64(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    keys, tokens = [0, 1, 2**62 - 1, 123456789], [0, 1, 5000, 151935]
    noise = exponential_noise(torch.tensor(keys), torch.tensor([tokens] * len(keys)))
    for r, key in enumerate(keys):
        for c, token in enumerate(tokens):
            z = splitmix64((key + (token + 1) * 0x9E3779B97F4A7C15) & mask)
            u = torch.tensor(((z >> 41) + 0.5) / 2**23, dtype=torch.float64).float()
            assert noise[r, c].item() == -u.log().item()
    # the extreme bits give a uniform inside (0, 1): noise never 0 (a ratio of inf or NaN) nor inf
    assert 0 < race_uniform(torch.tensor([0])).item() and race_uniform(torch.tensor([-1])).item() < 1
    draws = exponential_noise(torch.tensor([7]), torch.arange(200000)[None])[0]
    assert abs(draws.mean().item() - 1) < 0.01 and abs(draws.var().item() - 1) < 0.02  # Exp(1)


def test_exponential_race_kernel_is_the_reference():
    """The same column as probs / exponential_noise's argmax: whole-vocabulary rows, candidate columns with
    their token ids, zeros, a row of zeros (column 0, as torch's argmax) and a NaN (the first)."""
    from nanoqwen.ops.cpu import kernels as cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("nanoqwen's CPU kernels cannot be built here")
    g = torch.Generator().manual_seed(9)
    probs = torch.randn(6, 5000, generator=g).mul(2).softmax(-1)
    probs[1, ::3] = 0.0
    probs[2] = 0.0
    probs[3, [40, 70]] = float("nan")
    keys = torch.randint(0, 2**62, (6,), generator=g)
    got = cpu_kernels.exponential_race(probs, None, keys)
    assert torch.equal(got, exponential_race_reference(probs, None, keys))
    assert got[2] == 0 and got[3] == 40
    ids = torch.randint(0, 151936, (6, 5000), generator=g)
    assert torch.equal(cpu_kernels.exponential_race(probs, ids, keys), exponential_race_reference(probs, ids, keys))
    assert not torch.equal(cpu_kernels.exponential_race(probs, ids, keys), got)  # the ids set the noise


# --- batch invariance -----------------------------------------------------------------------------

def test_seeded_row_is_batch_invariant_with_penalties_on_other_rows():
    vocab, steps = 300, 12
    data = torch.Generator().manual_seed(4)
    step_logits = [torch.randn(4, vocab, generator=data) for _ in range(steps)]
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    others = [SamplingParams(repetition_penalty=1.3, top_k=5),
              SamplingParams(temperature=0, presence_penalty=1.0),
              SamplingParams(frequency_penalty=-0.5, min_tokens=5, logprobs=3)]
    alone_gen, batch_gen, shared = (torch.Generator().manual_seed(7),
                                    torch.Generator().manual_seed(7),
                                    torch.Generator().manual_seed(0))
    alone, batch, outputs = [], [], [[], [], []]
    for logits in step_logits:
        alone += tokens(logits[1:2], [seeded], generators=[alone_gen], prompts=[[1, 2]],
                        outputs=[alone[:]], stops=[{0}])
        out = tokens(logits, [others[0], seeded, others[1], others[2]],
                     generators=[shared, batch_gen, None, shared],
                     prompts=[[5, 6], [1, 2], [7], [8, 9]],
                     outputs=[outputs[0], batch[:], outputs[1], outputs[2]],
                     stops=[{0}, {0}, {0}, {1, 2}])
        batch.append(out[1])
        for o, t in zip(outputs, [out[0], out[2], out[3]], strict=True):
            o.append(t)
    assert alone == batch and len(set(alone)) > 3  # a real draw, not a constant


@pytest.mark.parametrize("seeded", [SamplingParams(temperature=0.9, top_p=0.95, seed=7),
                                    SamplingParams(temperature=1.2, top_k=40, seed=7)])
def test_seeded_row_draws_the_same_tokens_in_any_batch(seeded):
    """Alone, beside rows without a top_k (the whole vocabulary) and beside top_k rows (only the best
    columns): the same tokens from the same seed."""
    vocab, steps = 500, 20
    data = torch.Generator().manual_seed(6)
    step_logits = [torch.randn(3, vocab, generator=data) * 3 for _ in range(steps)]
    runs = {}
    for name, others in [("alone", []), ("vocabulary", [SamplingParams(), SamplingParams(top_p=0.5)]),
                         ("top_k", [SamplingParams(top_k=3), SamplingParams(top_k=50, min_p=0.2)])]:
        g, got = torch.Generator().manual_seed(7), []
        for logits in step_logits:
            out = tokens(logits[: 1 + len(others)], [seeded, *others],
                         generators=[g] + [None] * len(others))
            got.append(out[0])
        runs[name] = got
    assert runs["alone"] == runs["vocabulary"] == runs["top_k"] and len(set(runs["alone"])) > 5


# --- SamplingParams -------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5),
    ("max_tokens", 0), ("max_tokens", -3), ("seed", "x"), ("seed", -1), ("seed", 2**64),
    ("stop_token_ids", [-1]),
    ("n", 0), ("n", 1.5), ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("repetition_penalty", float("inf")), ("repetition_penalty", float("nan")),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01), ("frequency_penalty", 3.0),
    ("frequency_penalty", -2.5),
    ("frequency_penalty", float("nan")), ("min_tokens", -1), ("min_tokens", 17),
    ("min_tokens", 1.0),
    ("stop", ""), ("stop", ["ok", ""]), ("stop", ["ok", 3]), ("stop", 5),
    ("include_stop_str_in_output", "yes"), ("logprobs", -1), ("logprobs", 21), ("logprobs", True),
])
def test_invalid_sampling_values_name_the_field(field, value):
    with pytest.raises(InvalidRequestError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**{field: value})


def test_new_fields_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.n, p.repetition_penalty, p.presence_penalty, p.frequency_penalty,
            p.min_tokens) == (1, 1.0, 0.0, 0.0, 0)
    assert (p.stop, p.include_stop_str_in_output, p.logprobs,
            p.max_stop_len) == ([], False, None, 0)
    assert SamplingParams(stop="END").stop == ["END"]
    assert SamplingParams(stop=("a", "xyz")).stop == ["a", "xyz"]
    assert SamplingParams(stop=["a", "xyz", "bc"]).max_stop_len == 3
    assert SamplingParams(min_tokens=100, max_tokens=None).min_tokens == 100
    assert SamplingParams(min_tokens=16).min_tokens == 16  # equal to max_tokens is fine
    assert SamplingParams(logprobs=20).logprobs == 20 and SamplingParams(logprobs=0).logprobs == 0
    assert SamplingParams(presence_penalty=-2, frequency_penalty=2).frequency_penalty == 2
    # the leading fields keep their positions (positional arguments)
    old = SamplingParams(0.5, 10, 0.9, 0.1, 32, 1, [5], True, False)
    assert (old.temperature, old.top_k, old.max_tokens, old.stop_token_ids,
            old.ignore_eos) == (0.5, 10, 32, [5], True)
    assert old.skip_special_tokens is False


def test_a_top_k_beyond_the_vocabulary_keeps_every_token():
    """(2**70 overflowed the sampler's int64 tensor and failed the whole step, found by fuzzing the
    server.)"""
    logits = torch.randn(1, 50).expand(2, 50)  # the same row twice
    huge, off = SamplingParams(top_k=2**70), SamplingParams(top_k=-1)
    probs, ids = filter_probs(logits, [huge, off])
    assert torch.allclose(probs[0][ids[0].argsort()], logits[0].softmax(-1))
    assert torch.allclose(probs[0], probs[1])
