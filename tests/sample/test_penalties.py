"""The sampler's logit adjustments (nanoqwen/sample/penalties.py), each checked on known numbers, and the
sparse penalties against their dense reference."""

from __future__ import annotations

import pytest
import torch

from nanoqwen import SamplingParams
from nanoqwen.sample.penalties import apply_penalties, apply_penalties_reference, block_stop_tokens

GREEDY = SamplingParams(temperature=0)


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 0.0]])
    # token 0 in the prompt, token 1 in the output (twice), token 5 (logit 0) in the prompt;
    # 2, 3, 4 unseen
    out = apply_penalties(logits, [SamplingParams(repetition_penalty=2.0)], [[0, 5]], [[1, 1]])
    assert out.tolist() == [[1.0, -2.0, 0.5, -0.5, 3.0, 0.0]]
    # a penalty < 1 rewards repeats instead
    out = apply_penalties(logits, [SamplingParams(repetition_penalty=0.5)], [[0]], [[1]])
    assert out.tolist() == [[4.0, -0.5, 0.5, -0.5, 3.0, 0.0]]


def test_presence_and_frequency_penalties_subtract_exact_amounts_for_output_counts_0_1_3():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    # counts in the output: token 0 -> 0, 1 -> 1, 2 -> 3
    prompt, output = [[0, 0, 0, 3]], [[1, 2, 2, 2]]
    presence = apply_penalties(logits, [SamplingParams(presence_penalty=0.5)], prompt, output)
    assert presence[0].tolist() == pytest.approx([1.0, 0.5, 0.5, 1.0])
    frequency = apply_penalties(logits, [SamplingParams(frequency_penalty=0.25)], prompt, output)
    assert frequency[0].tolist() == pytest.approx([1.0, 0.75, 0.25, 1.0])
    both = apply_penalties(logits, [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)],
                           prompt, output)
    assert both[0].tolist() == pytest.approx([1.0, 1.0 - 0.75, 1.0 - 1.25, 1.0])
    negative = apply_penalties(logits,
                               [SamplingParams(presence_penalty=-1.0, frequency_penalty=-2.0)],
                               prompt, output)
    assert negative[0].tolist() == pytest.approx([1.0, 4.0, 8.0, 1.0])


def test_repetition_then_presence_frequency_in_order():
    logits = torch.tensor([[4.0, -2.0, 1.0]])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=0.5)
    out = apply_penalties(logits, [params], [[2]], [[0, 0, 1]])
    # token 0: 4 / 2 - 1 - 0.5 * 2; token 1: -2 * 2 - 1 - 0.5; token 2 (prompt only): 1 / 2
    assert out[0].tolist() == pytest.approx([0.0, -5.5, 0.5])


def test_penalties_on_seen_tokens_only_equal_the_dense_reference():
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(6, 300, generator=g) * 3
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(presence_penalty=0.7, frequency_penalty=-0.4),
              SamplingParams(), SamplingParams(repetition_penalty=0.8, presence_penalty=-1.5, frequency_penalty=2.0),
              SamplingParams(frequency_penalty=1.0), SamplingParams(repetition_penalty=1.1)]
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (40, 5, 9, 0, 12, 3)]
    outputs = [torch.randint(0, 50, (n,), generator=g).tolist() for n in (30, 60, 4, 25, 0, 7)]
    prompts[0] += [-3, 300, 10**6]  # ids outside the vocabulary count for nothing, in both
    expected = apply_penalties_reference(logits, params, prompts, outputs)
    got = apply_penalties(logits, params, prompts, outputs)
    assert not torch.equal(expected, logits)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_no_penalty_no_min_tokens_means_no_copy():
    logits = torch.randn(2, 10)
    params = [SamplingParams(), GREEDY]
    assert apply_penalties(logits, params, [[1]] * 2, [[2]] * 2) is logits
    assert block_stop_tokens(logits, params, [[2]] * 2, [{3}] * 2) is logits
    # min_tokens already reached: nothing to block either
    assert block_stop_tokens(logits, [SamplingParams(min_tokens=1)] * 2, [[2]] * 2,
                             [{3}] * 2) is logits
