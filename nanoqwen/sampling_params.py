"""SamplingParams: how one request picks its tokens and when it stops
(vLLM's names and defaults)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from typing import Any

from nanoqwen.errors import InvalidRequestError

MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_N = 128  # answers to one request (each is a sequence with its own KV cache)
# repetition_penalty's range: a seen token's positive logit is divided by it, a negative one multiplied, in float32
# (a penalty near 0 or huge sends logits to +-inf, and the answer has no token to pick)
REPETITION_PENALTY_RANGE = (0.01, 100.0)
# the longest stop string: each generated token is checked against the newest text plus this many characters
# before it, for every stop string (the engine's max_stop_sequences bounds how many)
MAX_STOP_STRING_LENGTH = 1024
# vLLM's floor for a positive temperature: logits / 1e-39 overflow to inf, and the softmax to NaN
MIN_TEMPERATURE = 0.01
# llama.cpp's default DRY sequence breakers (text-generation-webui's too)
DEFAULT_DRY_SEQUENCE_BREAKERS = ("\n", ":", "\"", "*")
MAX_DRY_SEQUENCE_BREAKERS = 64  # each is matched against the whole vocabulary once (then cached)

logger = logging.getLogger("nanoqwen")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """What the answer must be, as vLLM spells it: exactly one of json (a JSON schema, as a dict or
    a string), json_object=True (any JSON object), regex, choice (one of these strings) or grammar
    (Lark or GBNF/EBNF). disable_any_whitespace: JSON without optional whitespace."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                "StructuredOutputsParams needs exactly one of json, regex, choice, grammar, "
                f"json_object; got {', '.join(given) if given else 'none'}")
        kind = given[0]
        value = getattr(self, kind)
        valid = {"json": isinstance(value, (str, dict)), "regex": isinstance(value, str),
                 "grammar": isinstance(value, str), "json_object": value is True,
                 "choice": isinstance(value, list) and bool(value)
                 and all(isinstance(c, str) for c in value)}[kind]
        if not valid:
            rule = {"json": "a JSON schema (dict or string)", "regex": "a string",
                    "grammar": "a string", "json_object": "True",
                    "choice": "a non-empty list of strings"}[kind]
            raise InvalidRequestError(f"StructuredOutputsParams.{kind}={value!r:.100} is invalid: "
                                      f"must be {rule}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise InvalidRequestError("StructuredOutputsParams.disable_any_whitespace must be "
                                      "True or False")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str, bool]:
        """(kind, text, compact): what the compiled grammar depends on (the cache key)."""
        value = getattr(self, self.kind)
        if isinstance(value, (dict, list)) or value is True:
            value = json.dumps(value, sort_keys=True)
        return self.kind, value, self.disable_any_whitespace


@dataclass
class SamplingParams:
    """temperature 0 means greedy (one in (0, 0.01) samples at 0.01, as in vLLM); top_k -1 (or 0),
    top_p 1 and min_p 0 turn each filter off.

    Filters apply in transformers' order: temperature, top_k, top_p, min_p. Before them come
    min_tokens (stop ids blocked), repetition_penalty (prompt and output tokens), then
    presence_penalty / frequency_penalty (output tokens only); 1.0 / 0.0 / 0.0 turn them off.
    `stop` is normalised to a (possibly empty) list of strings; `logprobs` None is off, N >= 0
    returns the sampled token's log-probability plus the N most likely alternatives.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int | None = 16  # None: up to the context length
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    # None: off; k >= 0: RequestOutput.prompt_logprobs, one entry per prompt token (the first None), each the
    # prompt token's log-probability under the raw logits (with its rank) plus the k most likely tokens at that
    # position, as vLLM. Computed in the prompt's own prefill (every chunk's positions through the LM head);
    # such a request skips the prefix cache lookup (as vLLM does: a cached prefix has no hidden states to read
    # them from), though the blocks it computes are cached for others.
    prompt_logprobs: int | None = None
    # the answer must follow a JSON schema, regex, choice or grammar (nanoqwen/sample/structured_outputs.py)
    structured_outputs: StructuredOutputsParams | None = None
    # DRY ("don't repeat yourself", llama.cpp's and text-generation-webui's; nanoqwen/sample/dry.py): a token that
    # would extend a run of L >= dry_allowed_length tokens repeating earlier context loses
    # dry_multiplier * dry_base ** (L - dry_allowed_length) from its logit. dry_multiplier 0 turns it off;
    # dry_penalty_last_n: how many of the latest tokens (prompt and output) it looks at, -1 all, 0 none;
    # dry_sequence_breakers: strings no repeated run reaches across (None: DEFAULT_DRY_SEQUENCE_BREAKERS)
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: list[str] | None = None
    # vLLM's: at most this many tokens of reasoning (a prompt that leaves the answer inside Qwen3's <think>), then
    # </think> is forced; None: no limit, 0: </think> first (nanoqwen/sample/structured_outputs.py, GrammarState)
    thinking_token_budget: int | None = None
    # dry_sequence_breakers as token ids (a sample.dry.DryBreakers), which the engine fills in from its tokenizer
    _dry_breakers: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def bad(field: str, value: object, rule: str) -> InvalidRequestError:
            return InvalidRequestError(f"SamplingParams.{field}={value!r:.200} is invalid: {rule}", param=field)

        if not _is_number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise bad("temperature", self.temperature, "must be a finite number >= 0 (0 means greedy)")
        if 0 < self.temperature < MIN_TEMPERATURE:
            logger.warning("temperature %g is below %g, whose logits / temperature overflow: "
                           "sampling at %g (0 means greedy)", self.temperature, MIN_TEMPERATURE,
                           MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", self.top_k, "must be an integer >= 1, or -1 / 0 to disable")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", self.min_p, "must be in [0, 1]")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens,
                      "must be an integer >= 1 (or None for no limit)")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < 2**63 - 1024):
            # seed + i for n > 1
            raise bad("seed", self.seed, "must be an integer in [0, 2**63 - 1024) or None")
        if self.stop_token_ids is not None and (
                not isinstance(self.stop_token_ids, (list, tuple))
                or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids)):
            # (each must also be in the model's vocabulary: the engine checks, it knows the vocabulary)
            raise bad("stop_token_ids", self.stop_token_ids, "must be a list of token ids (integers >= 0)")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", self.n, f"must be an integer in [1, {MAX_N}]")
        rep = self.repetition_penalty
        low, high = REPETITION_PENALTY_RANGE
        if not _is_number(rep) or not low <= rep <= high:
            raise bad("repetition_penalty", rep, f"must be a number in [{low}, {high:g}] (1 disables it)")
        for field in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, field)
            if not _is_number(value) or not -2 <= value <= 2:
                raise bad(field, value, "must be in [-2, 2] (0 disables it)")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"must be <= max_tokens ({self.max_tokens})")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is None:
            stop = []
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise bad("stop", self.stop,
                      "must be a non-empty string or a list of non-empty strings")
        if any(len(s) > MAX_STOP_STRING_LENGTH for s in stop):
            raise bad("stop", max(stop, key=len), f"a stop string is at most {MAX_STOP_STRING_LENGTH} characters")
        for field in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, field), bool):
                raise bad(field, getattr(self, field), "must be True or False")
        if self.logprobs is not None and (not _is_int(self.logprobs)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", self.logprobs,
                      f"must be an integer in [0, {MAX_LOGPROBS}] (or None for off)")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise bad("prompt_logprobs", self.prompt_logprobs,
                      f"must be an integer in [0, {MAX_LOGPROBS}] (or None for off)")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            raise bad("structured_outputs", self.structured_outputs,
                      "must be a StructuredOutputsParams (or None)")
        self._check_dry_and_thinking(bad)
        self.stop = list(stop)
        self._max_stop_len = max(map(len, self.stop), default=0)
        if self.top_k == 0:
            self.top_k = -1

    def _check_dry_and_thinking(self, bad: Any) -> None:
        """Check the DRY and thinking_token_budget fields (bad: the error for a field)."""
        if not _is_number(self.dry_multiplier) or not 0 <= self.dry_multiplier < math.inf:
            raise bad("dry_multiplier", self.dry_multiplier, "must be a finite number >= 0 (0 disables DRY)")
        if not _is_number(self.dry_base) or not 1 <= self.dry_base < math.inf:
            raise bad("dry_base", self.dry_base, "must be a finite number >= 1")
        if not _is_int(self.dry_allowed_length) or self.dry_allowed_length < 1:
            raise bad("dry_allowed_length", self.dry_allowed_length, "must be an integer >= 1")
        if not _is_int(self.dry_penalty_last_n) or self.dry_penalty_last_n < -1:
            raise bad("dry_penalty_last_n", self.dry_penalty_last_n,
                      "must be an integer >= -1 (-1: the whole context, 0: DRY off)")
        breakers = self.dry_sequence_breakers
        if breakers is None:
            breakers = list(DEFAULT_DRY_SEQUENCE_BREAKERS)
        if not isinstance(breakers, (list, tuple)) or not all(isinstance(b, str) and b for b in breakers):
            raise bad("dry_sequence_breakers", self.dry_sequence_breakers,
                      "must be a list of non-empty strings (or None for the defaults)")
        if len(breakers) > MAX_DRY_SEQUENCE_BREAKERS:
            raise bad("dry_sequence_breakers", self.dry_sequence_breakers,
                      f"at most {MAX_DRY_SEQUENCE_BREAKERS} sequence breakers")
        self.dry_sequence_breakers = list(breakers)
        if self.thinking_token_budget is not None and (not _is_int(self.thinking_token_budget)
                                                       or self.thinking_token_budget < 0):
            raise bad("thinking_token_budget", self.thinking_token_budget,
                      "must be an integer >= 0 (or None for no limit)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def max_stop_len(self) -> int:
        """Length of the longest stop string (0 without any): how much text may
        still turn into a stop."""
        return self._max_stop_len
