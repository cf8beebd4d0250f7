"""SamplingParams: how one request picks its tokens and when it stops
(vLLM's names and defaults)."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass

from nanoqwen.errors import InvalidRequestError

MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_N = 128  # answers to one request (each is a sequence with its own KV cache)
# the longest stop string: each generated token is checked against the newest text plus this many characters
# before it, for every stop string (the engine's max_stop_sequences bounds how many)
MAX_STOP_STRING_LENGTH = 1024
# vLLM's floor for a positive temperature: logits / 1e-39 overflow to inf, and the softmax to NaN
MIN_TEMPERATURE = 0.01

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
    # the answer must follow a JSON schema, regex, choice or grammar (nanoqwen/sample/structured_outputs.py)
    structured_outputs: StructuredOutputsParams | None = None

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
        if not _is_number(rep) or not (rep > 0 and math.isfinite(rep)):
            raise bad("repetition_penalty", rep, "must be a finite number > 0 (1 disables it)")
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
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputsParams):
            raise bad("structured_outputs", self.structured_outputs,
                      "must be a StructuredOutputsParams (or None)")
        self.stop = list(stop)
        self._max_stop_len = max(map(len, self.stop), default=0)
        if self.top_k == 0:
            self.top_k = -1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def max_stop_len(self) -> int:
        """Length of the longest stop string (0 without any): how much text may
        still turn into a stop."""
        return self._max_stop_len
