"""DRY: the reference against hand-worked penalties, the sampler's batched path against the reference, breakers
from the tokenizer, and loops broken (crafted logits through the sampler; a random model through the engine)."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import make_llm

from nanoqwen import SamplingParams
from nanoqwen.errors import InvalidRequestError
from nanoqwen.sample.dry import (
    DryBreakers,
    apply_dry,
    dry_penalties_reference,
    max_exponent,
    resolve_dry_breakers,
)
from nanoqwen.sample.sampler import sample
from nanoqwen.tokenizer import Tokenizer

ASSETS = "nanoqwen/assets/qwen3-0.6b"


def dry(breakers: dict | None = None, **kwargs) -> SamplingParams:
    params = SamplingParams(dry_multiplier=kwargs.pop("multiplier", 0.8), **kwargs)
    params._dry_breakers = DryBreakers(breakers or {})
    return params


# llama.cpp's worked example (the comment in llama_sampler_dry_apply): a b c c b c y a b c
A, B, C, Y = 1, 2, 3, 4


def test_llama_cpp_example():
    """Repeat counts 0 0 3 1 0 2 0 0 0 0: c follows a run of 3 (a b c), y one of 2 (b c), b one of 1 (c, under
    dry_allowed_length 2: free). 0.8 * 1.75 ** (3 - 2) and 0.8 * 1.75 ** 0."""
    penalties = dry_penalties_reference([A, B, C, C, B, C, Y, A, B, C], dry())
    assert penalties == pytest.approx({C: 0.8 * 1.75, Y: 0.8})
    assert dry_penalties_reference([A, B, C, C, B, C, Y, A, B, C], dry(dry_allowed_length=1)) == pytest.approx(
        {C: 0.8 * 1.75 ** 2, Y: 0.8 * 1.75, B: 0.8})


def test_single_token_breaker_caps_the_run_and_is_never_penalised():
    # a b c 9 a b c: the run a b c is capped by the breaker at 3 tokens; it is followed by the breaker: free
    assert dry_penalties_reference([A, B, C, 9, A, B, C], dry()) == pytest.approx({9: 0.8 * 1.75})
    assert dry_penalties_reference([A, B, C, 9, A, B, C], dry({9: ((),)})) == {}
    # the last token a breaker: nothing to continue
    assert dry_penalties_reference([A, B, 9, A, B, 9], dry({9: ((),)})) == {}
    # 5 a b c 6 9 a b c: the run after the breaker (a b c, 3 tokens) repeats: 6 loses 0.8 * 1.75
    assert dry_penalties_reference([5, A, B, C, 6, 9, A, B, C], dry({9: ((),)})) == pytest.approx({6: 1.4})


def test_multi_token_breaker():
    """7 8 is a restart sequence (head 7, tail 8); 7 alone is not. In 7 8 c y 5 7 8 c y the repeat of
    7 8 c y (4 tokens) is capped at the 2 after the restart sequence: 5 loses 0.8 * 1.75 ** 0, not ** 2."""
    context = [7, 8, C, Y, 5, 7, 8, C, Y]
    assert dry_penalties_reference(context, dry()) == pytest.approx({5: 0.8 * 1.75 ** 2})
    assert dry_penalties_reference(context, dry({7: ((8,),)})) == pytest.approx({5: 0.8})
    # 7 followed by something else restarts nothing
    assert dry_penalties_reference([7, 9, C, Y, 5, 7, 9, C, Y], dry({7: ((8,),)})) == pytest.approx(
        {5: 0.8 * 1.75 ** 2})


def test_penalty_last_n_and_off_switches():
    context = [A, B, C, C, B, C, Y, A, B, C]
    # the last 4 tokens: y a b c, no repeat in them
    assert dry_penalties_reference(context, dry(dry_penalty_last_n=4)) == {}
    # the last 7: c b c y a b c: b c repeats (c b c): y loses 0.8
    assert dry_penalties_reference(context, dry(dry_penalty_last_n=7)) == pytest.approx({Y: 0.8})
    assert dry_penalties_reference(context, dry(dry_penalty_last_n=0)) == {}
    assert dry_penalties_reference(context, dry(multiplier=0.0)) == {}


def test_exponent_is_clamped_as_llama_cpp():
    assert max_exponent(1.75) == int(88.7228391 / 0.5596157879354227)
    assert max_exponent(1.0) == 0  # no clamp
    run = [A] * 400
    penalties = dry_penalties_reference(run, dry(dry_base=2.0, multiplier=1e-30))
    assert penalties[A] == pytest.approx(1e-30 * 2.0 ** max_exponent(2.0))


def random_case(rng: random.Random) -> tuple[SamplingParams, list[int], list[int]]:
    heads: dict[int, tuple[tuple[int, ...], ...]] = {}
    for head in rng.sample(range(6), rng.randint(0, 2)):
        tails = {tuple(rng.randrange(6) for _ in range(rng.randint(0, 2))) for _ in range(rng.randint(1, 2))}
        heads[head] = tuple(tails)
    params = dry(heads, multiplier=rng.choice([0.0, 0.8, 2.0]), dry_base=rng.choice([1.0, 1.1, 1.75, 3.0]),
                 dry_allowed_length=rng.randint(1, 3), dry_penalty_last_n=rng.choice([-1, 0, 5, 40]))
    k = rng.randint(2, 6)  # a small alphabet: many repeats
    prompt = [rng.randrange(k) for _ in range(rng.randint(0, 30))]
    output = [rng.randrange(k) for _ in range(rng.randint(1, 60))]
    return params, prompt, output


def test_batched_path_equals_the_reference():
    rng = random.Random(0)
    changed = 0
    for _ in range(300):
        cases = [random_case(rng) for _ in range(rng.randint(1, 4))]
        params, prompts, outputs = (list(x) for x in zip(*cases, strict=True))
        logits = torch.randn(len(cases), 8)
        got = apply_dry(logits, params, prompts, outputs)
        want = logits.clone()
        for row, (p, prompt, output) in enumerate(cases):
            for token, penalty in dry_penalties_reference(prompt + output, p).items():
                want[row, token] -= penalty
        torch.testing.assert_close(got, want)
        changed += not torch.equal(got, logits)
    assert changed > 100  # most cases penalise something


def test_no_dry_row_costs_nothing():
    logits = torch.randn(2, 8)
    assert apply_dry(logits, [SamplingParams(), SamplingParams()], [[1, 1, 1]] * 2, [[1, 1, 1]] * 2) is logits


def test_breakers_from_the_tokenizer():
    tokenizer = Tokenizer.from_pretrained(ASSETS)
    breakers = DryBreakers.from_tokenizer(tokenizer, ("\n", ":", "\"", "*"))
    newline, colon = tokenizer.encode("\n")[0], tokenizer.encode(":")[0]
    assert {newline, colon, tokenizer.encode(".\n\n")[0]} <= breakers.single  # every token whose text has one
    assert tokenizer.encode(" the")[0] not in breakers.single
    # a breaker longer than its tokens: "Xyz:" heads are tokens ending with "X", "Xy" or "Xyz", each with the
    # rest's tokenization as tail
    multi = DryBreakers.from_tokenizer(tokenizer, ("Xyz:",))
    head = tokenizer.encode("X")[0]
    assert tuple(tokenizer.encode("yz:")) in multi.heads[head]
    assert head not in multi.single
    assert DryBreakers.from_tokenizer(tokenizer, ("Xyz:",)) is multi  # cached
    params = SamplingParams(dry_multiplier=0.5)
    resolve_dry_breakers(params, tokenizer)
    assert newline in params._dry_breakers.single


def looping_logits(context: list[int]) -> torch.Tensor:
    """A fake model over 12 tokens whose greedy continuation cycles 0 1 2 3 4 0 1 ...: after t, t + 1 (mod 5)
    scores 3, and t + 6 (a token outside the cycle) 2.5; everything else 0."""
    logits = torch.zeros(12)
    last = context[-1] % 5
    logits[(last + 1) % 5] = 3.0
    logits[last + 6] = 2.5
    return logits


def run(params: SamplingParams, steps: int) -> list[int]:
    prompt, output = [0], []
    for _ in range(steps):
        logits = looping_logits(prompt + output)[None]
        out = sample(logits, [params], [None], [prompt], [output], [set()])
        output.append(int(out.token_ids[0]))
    return output


def test_dry_breaks_a_greedy_loop():
    plain = run(SamplingParams(temperature=0), 30)
    assert plain[:10] == [1, 2, 3, 4, 0, 1, 2, 3, 4, 0]  # loops
    broken = run(dry(temperature=0), 30)
    assert broken[:5] == [1, 2, 3, 4, 0]  # the first pass is no repeat
    # then 0 1 repeats the prompt's 0 and the first 1 (a run of 2): 2 loses 0.8 and the second choice (7) wins;
    # the cycle never runs whole again
    cycle = [1, 2, 3, 4, 0]
    assert not any(broken[i:i + 5] == cycle for i in range(1, len(broken) - 4))
    assert broken != plain


def longest_streak(tokens: list[int]) -> int:
    best = streak = 1
    for a, b in zip(tokens, tokens[1:], strict=False):
        streak = streak + 1 if a == b else 1
        best = max(best, streak)
    return best


@pytest.fixture(scope="module")
def llm(checkpoint):
    return make_llm(checkpoint("tiny", std=0.08), max_model_len=256, kv_cache_memory=16 << 20)


def test_engine_breaks_a_random_models_loop(llm):
    """This random model's greedy answer repeats one token dozens of times; with DRY no token runs more than a
    few times (each repeat costs more)."""
    prompt = "The cat sat on the mat."
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                         use_tqdm=False)[0].token_ids
    assert longest_streak(plain) >= 20
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, dry_multiplier=0.8)
    with_dry = llm.generate([prompt], params, use_tqdm=False)[0].token_ids
    assert longest_streak(with_dry) <= 5
    assert params._dry_breakers is not None  # the engine resolved the breakers


@pytest.mark.parametrize(("field", "value"), [
    ("dry_multiplier", -0.1), ("dry_multiplier", float("inf")), ("dry_multiplier", "1"),
    ("dry_base", 0.5), ("dry_base", float("nan")), ("dry_allowed_length", 0), ("dry_allowed_length", 1.5),
    ("dry_penalty_last_n", -2), ("dry_sequence_breakers", "\n"), ("dry_sequence_breakers", [""]),
    ("dry_sequence_breakers", [1]),
])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(InvalidRequestError, match=field) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field


def test_defaults_are_llama_cpps():
    p = SamplingParams()
    assert (p.dry_multiplier, p.dry_base, p.dry_allowed_length, p.dry_penalty_last_n) == (0.0, 1.75, 2, -1)
    assert p.dry_sequence_breakers == ["\n", ":", "\"", "*"]
    assert SamplingParams(dry_sequence_breakers=[]).dry_sequence_breakers == []


@pytest.mark.slow
def test_speculative_decoding_keeps_dry_answers(checkpoint):
    """Verifying drafts applies DRY to each draft row over the answer so far and the drafts before it: the greedy
    answer is the one without speculation (n-gram drafts, which a looping model makes plenty of)."""
    path = checkpoint("tiny", std=0.08)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, dry_multiplier=0.8)
    prompt = "The cat sat on the mat."
    expected = make_llm(path).generate([prompt], params, use_tqdm=False)[0].token_ids
    spec = make_llm(path, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                              "prompt_lookup_min": 1, "disable_by_batch_size": 8,
                                              "disable_by_acceptance": False})
    assert spec.generate([prompt], params, use_tqdm=False)[0].token_ids == expected
    assert spec.llm_engine.spec_stats["num_drafts"] > 0
