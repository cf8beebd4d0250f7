"""The DRY sampling flags of `nanoqwen generate` and `nanoqwen chat` (llama.cpp's names) as SamplingParams."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nanoqwen import SamplingParams
from nanoqwen.entrypoints.cli import build_parser, sampling_params
from nanoqwen.errors import InvalidRequestError

DEFAULTS = SimpleNamespace(get_default_sampling_params=lambda: SamplingParams(temperature=0.6, top_p=0.95))


def parse(*flags: str, command: str = "generate"):
    args = ["generate", "--prompt", "hi"] if command == "generate" else ["chat"]
    return build_parser().parse_args([*args, *flags])


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_dry_flags_become_sampling_params(command):
    args = parse("--dry-multiplier", "0.8", "--dry-base", "2", "--dry-allowed-length", "3",
                 "--dry-penalty-last-n", "64", "--dry-sequence-breaker", "\n", "--dry-sequence-breaker", "User:",
                 command=command)
    params = sampling_params(DEFAULTS, args)
    assert (params.dry_multiplier, params.dry_base, params.dry_allowed_length, params.dry_penalty_last_n) == (
        0.8, 2.0, 3, 64)
    assert params.dry_sequence_breakers == ["\n", "User:"]  # given breakers replace the defaults
    assert (params.temperature, params.top_p) == (0.6, 0.95)  # the model's defaults stay


def test_without_dry_flags_dry_is_off_with_llama_cpps_defaults():
    params = sampling_params(DEFAULTS, parse())
    assert (params.dry_multiplier, params.dry_base, params.dry_allowed_length, params.dry_penalty_last_n) == (
        0.0, 1.75, 2, -1)
    assert params.dry_sequence_breakers == ["\n", ":", "\"", "*"]


def test_none_clears_the_breakers():
    assert sampling_params(DEFAULTS, parse("--dry-sequence-breaker", "none")).dry_sequence_breakers == []


def test_a_bad_value_names_the_field():
    with pytest.raises(InvalidRequestError, match="dry_base"):
        sampling_params(DEFAULTS, parse("--dry-base", "0.5"))
