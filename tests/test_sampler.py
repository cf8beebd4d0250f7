"""Sampling filters, each checked on a known distribution so that ignoring it would fail."""

from __future__ import annotations

import math

import pytest
import torch

from nanoqwen import InvalidRequestError, SamplingParams
from nanoqwen.sampler import filter_probs, sample

# probabilities 0.4, 0.3, 0.15, 0.1, 0.05 over tokens 0..4, in shuffled token order
PROBS = torch.tensor([0.1, 0.4, 0.05, 0.3, 0.15])
LOGITS = PROBS.log()[None, :]


def kept(params: SamplingParams) -> dict[int, float]:
    probs, ids = filter_probs(LOGITS.clone(), [params])
    return {int(i): round(float(p), 4) for p, i in zip(probs[0], ids[0], strict=True) if p > 0}


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
    probs, ids = filter_probs(logits, [SamplingParams(top_k=1), SamplingParams(), SamplingParams(top_p=0.7)])
    support = [{int(i) for p, i in zip(probs[r], ids[r], strict=True) if p > 0} for r in range(3)]
    assert support == [{1}, {0, 1, 2, 3, 4}, {1, 3}]


def test_top_k_1_equals_greedy_and_temperature_0_is_argmax():
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(top_k=1, temperature=1.5)] * 2 + [SamplingParams(temperature=0)] * 2
    assert sample(logits, params, [None] * 4).tolist() == logits.argmax(-1).tolist()


def test_samples_follow_the_distribution():
    n = 4000
    gen = torch.Generator().manual_seed(0)
    draws = sample(LOGITS.repeat(n, 1), [SamplingParams()] * n, [gen] * n)
    freq = torch.bincount(draws, minlength=5).float() / n
    # each frequency within 4 standard errors of its probability
    for p, f in zip(PROBS.tolist(), freq.tolist(), strict=True):
        assert abs(f - p) < 4 * math.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5),
    ("max_tokens", 0), ("max_tokens", -3), ("seed", "x"), ("stop_token_ids", [-1]),
])
def test_invalid_sampling_values_name_the_field(field, value):
    with pytest.raises(InvalidRequestError, match=rf"SamplingParams\.{field}="):
        SamplingParams(**{field: value})
