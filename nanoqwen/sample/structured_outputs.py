"""Structured outputs: every sampled token is one a JSON schema, regex, choice or grammar allows.

The grammar engine is llguidance (Microsoft's, also one of vLLM's backends): it compiles JSON
schemas, regexes and Lark/EBNF grammars against the tokenizer, and for each step gives the set of
allowed tokens as a bitmask (one bit per vocabulary entry) in microseconds, with no precomputation
per grammar. It reads the `tokenizers` JSON nanoqwen already loads, so it needs nothing else
(xgrammar, the other well-kept engine, pulls in transformers). How vLLM drives them, done here:

- the engine keeps one `GrammarCompiler`; a request's grammar is compiled once per distinct text
  (cached) and each sequence gets its own matcher, a copy of the compiled one (`GrammarState`);
- each step, the sampler sets the logits of tokens outside a constrained row's bitmask to -inf
  before penalties, temperature and filters (sampler.py), so every sampling option still holds and
  logprobs are those of the masked distribution;
- after the step the output processor feeds the sampled token to the matcher; when the grammar
  is complete and allows nothing more, the answer ends ("stop").

Qwen3's thinking: when the prompt opens the assistant's turn with thinking on (it ends with
"<|im_start|>assistant\\n", or inside an unclosed <think>), the reasoning up to </think> is free
and the constraint applies from there on; otherwise from the first token. GrammarCompiler.prompt_is_reasoning
decides it, for the grammar and for SamplingParams.thinking_token_budget: a sequence with a budget and no
grammar gets a GrammarState without a matcher, whose bitmask forces </think> once the budget is spent.
"""

from __future__ import annotations

import json
import threading
from functools import cache, lru_cache
from typing import Any

import torch

from nanoqwen.errors import InvalidRequestError
from nanoqwen.sampling_params import StructuredOutputsParams
from nanoqwen.tokenizer import Tokenizer

# The whitespace a JSON answer may hold between its tokens: none, one space, or one or two newlines and an indent of
# at most 20 spaces or tabs, as llama.cpp's JSON grammars allow (its json_schema_to_grammar's SPACE_RULE). Unbounded
# whitespace let a model spend its whole answer on newlines inside the first brace.
JSON_WHITESPACE = r"[ ]?|\n{1,2}[ \t]{0,20}"


def _grammar_text(kind: str, text: str, compact: bool) -> str:
    """The llguidance grammar for a request's constraint (not yet checked). compact: JSON with no
    whitespace at all (vLLM's disable_any_whitespace); else JSON_WHITESPACE between tokens."""
    import llguidance

    options = ({"whitespace_flexible": False} if compact
               else {"whitespace_flexible": True, "whitespace_pattern": JSON_WHITESPACE})
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else json.loads(text)
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema is a JSON object, not {type(schema).__name__}")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
    if kind == "choice":
        choices = json.loads(text)
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in choices))
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    return llguidance.grammar_from("grammar", text)  # Lark, or GBNF converted to Lark


class GrammarCompiler:
    """Compiles requests' constraints against the model's tokenizer, once per distinct text.

    The llguidance tokenizer (slow to build: bench/bench_structured.py times it) is made on first use;
    `compile` may run in another thread (the server compiles off its engine loop), so both are guarded by a lock.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.think_end_id = tokenizer.token_to_id("</think>")
        self.think_start_id = tokenizer.token_to_id("<think>")
        self.assistant_header = tokenizer.encode("<|im_start|>assistant\n")
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._compile = lru_cache(maxsize=256)(self._compile_uncached)

    @property
    def ll_tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance

                self._ll_tokenizer = llguidance.LLTokenizer(
                    self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                    eos_token=self.eos_token_ids)
            return self._ll_tokenizer

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled matcher for params (cached by its text); an InvalidRequestError that says
        what is wrong when it cannot be compiled."""
        return self._compile(*params.key())

    def _compile_uncached(self, kind: str, text: str, compact: bool) -> Any:
        import llguidance

        try:
            grammar = _grammar_text(kind, text, compact)
        except (ValueError, TypeError) as e:  # not JSON, or a GBNF that does not convert
            raise InvalidRequestError(f"structured outputs: the {kind} is invalid: {e}") from None
        tokenizer = self.ll_tokenizer
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error or messages:
            # llguidance ignores what it does not support with a warning: a 400 here, so a
            # constraint is never silently weaker than asked
            what = "cannot be compiled" if is_error else "uses what the grammar engine does not support"
            raise InvalidRequestError(f"structured outputs: the {kind} {what}: "
                                      f"{'; '.join(m.strip() for m in messages)}")
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"structured outputs: the {kind} cannot be compiled: "
                                      f"{matcher.get_error()}")
        return matcher

    def new_state(self, params: StructuredOutputsParams | None, prompt_token_ids: list[int],
                  thinking_token_budget: int | None = None) -> GrammarState | None:
        """A sequence's own matcher (params None: none), whether it first reasons freely up to </think>, and
        how many tokens of reasoning it may write before </think> is forced (None: no limit). None when
        there is nothing to follow: no grammar, and no budget or no reasoning."""
        reasoning = self.prompt_is_reasoning(prompt_token_ids)
        if params is None and (thinking_token_budget is None or not reasoning):
            return None
        matcher = self.compile(params).deep_copy() if params is not None else None
        return GrammarState(matcher, reasoning, self.think_end_id,
                            thinking_token_budget if reasoning else None, self.vocab_size)

    def prompt_is_reasoning(self, prompt_token_ids: list[int]) -> bool:
        """Whether the prompt leaves its answer reasoning (Qwen3 with thinking on): it ends with the
        assistant's header, or inside an unclosed <think>. The one place that decides it."""
        return self.think_end_id is not None and (
            prompt_token_ids[-len(self.assistant_header):] == self.assistant_header
            or self._inside_think(prompt_token_ids))

    def _inside_think(self, token_ids: list[int]) -> bool:
        for token in reversed(token_ids):
            if token == self.think_end_id:
                return False
            if token == self.think_start_id:
                return True
        return False


class GrammarState:
    """One sequence's progress through its grammar (matcher None: no grammar) and its reasoning.

    thinking_token_budget (SamplingParams'): once that many tokens of reasoning are written without
    </think>, the next token's bitmask allows </think> alone, so the model answers from there on."""

    def __init__(self, matcher: Any, reasoning: bool, think_end_id: int | None,
                 thinking_token_budget: int | None = None, vocab_size: int = 0) -> None:
        self.matcher = matcher
        self.reasoning = reasoning  # free tokens until </think>
        self.think_end_id = think_end_id
        self.thinking_token_budget = thinking_token_budget
        self.num_reasoning_tokens = 0  # written while reasoning
        self.vocab_size = vocab_size

    def bitmask(self) -> torch.Tensor | None:
        """The tokens allowed next, one bit each: int32 [ceil(V / 32)]; None while reasoning within its
        budget, or with no grammar once past it."""
        if self.reasoning:
            budget = self.thinking_token_budget
            if budget is None or self.num_reasoning_tokens < budget or self.think_end_id is None:
                return None
            # bit i of word j is token 32j + i: as little-endian bytes, bit i % 8 of byte i // 8
            mask = torch.zeros(4 * -(-max(self.vocab_size, self.think_end_id + 1) // 32), dtype=torch.uint8)
            mask[self.think_end_id // 8] = 1 << (self.think_end_id % 8)
            return mask.view(torch.int32)
        if self.matcher is None:
            return None
        return torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)

    def accept(self, token_id: int) -> None:
        if self.reasoning:
            self.reasoning = token_id != self.think_end_id
            self.num_reasoning_tokens += self.reasoning
            return
        if self.matcher is not None and not self.matcher.consume_token(token_id):
            # only allowed tokens are sampled, so this is a bug, not bad input
            raise RuntimeError(f"token {token_id} was sampled outside its grammar: "
                               f"{self.matcher.get_error()}")

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and allows nothing more (EOS aside)."""
        return not self.reasoning and self.matcher is not None and self.matcher.is_stopped()


def apply_bitmasks(logits: torch.Tensor, bitmasks: list[torch.Tensor | None]) -> torch.Tensor:
    """logits [B, V] -> a copy with each constrained row's disallowed tokens at -inf (logits itself
    when no row is constrained)."""
    rows = [i for i, m in enumerate(bitmasks) if m is not None]
    if not rows:
        return logits
    vocab, device = logits.shape[1], logits.device
    words = torch.stack([bitmasks[i] for i in rows]).to(device)  # [R, ceil(V / 32)] int32
    # bit i of word j is token 32j + i: read the words as little-endian bytes and each byte's 8
    # bits from a 256-entry table (a gather, far cheaper than 32 shifts per word)
    table = _byte_bits(device)  # [256, 8] bool
    allowed = table[words.view(torch.uint8).long()].flatten(1)[:, :vocab]  # [R, V]
    if len(rows) == logits.shape[0]:
        return logits.masked_fill(~allowed, float("-inf"))
    blocked = torch.zeros(logits.shape, dtype=torch.bool, device=device)
    blocked[torch.tensor(rows, device=device)] = ~allowed
    return logits.masked_fill(blocked, float("-inf"))


@cache
def _byte_bits(device: torch.device) -> torch.Tensor:
    """[256, 8] bool: row b holds the bits of byte b, lowest first."""
    return ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool().to(device)
