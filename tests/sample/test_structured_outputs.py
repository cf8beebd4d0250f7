"""Structured outputs on random-weight checkpoints: a random model's free output is gibberish, so an
answer that parses and validates is the constraint's doing."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest
import torch
from conftest import make_llm

from nanoqwen import SamplingParams
from nanoqwen.errors import InvalidRequestError
from nanoqwen.sample.structured_outputs import apply_bitmasks
from nanoqwen.sampling_params import StructuredOutputsParams

PROMPT = "Tell me about a person."
# A dozen schemas: nested objects, arrays with bounds, enums, anyOf, bounded numbers, strings with
# patterns, required and optional fields. Strings are bounded so a random model finishes them.
NAME = {"type": "string", "maxLength": 6}
SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": NAME,
                                              "age": {"type": "integer", "minimum": 0, "maximum": 150}},
             "required": ["name", "age"], "additionalProperties": False},
    # (numbers bounded in range; a random model may write a fraction's digits forever, so the
    # fractional "number" type is left to json_object below)
    "bounded-numbers": {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "delta": {"type": "integer", "exclusiveMinimum": -10, "exclusiveMaximum": 10}},
        "required": ["age", "delta"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "size": {"enum": [1, 2, 3]}},
             "required": ["color", "size"], "additionalProperties": False},
    "array-bounds": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                     "minItems": 2, "maxItems": 4},
    "nested": {"type": "object", "properties": {
        "person": {"type": "object", "properties": {"name": NAME, "address": {
            "type": "object", "properties": {"city": NAME, "zip": {"type": "string",
                                                                   "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False}},
            "required": ["name", "address"], "additionalProperties": False}},
        "required": ["person"], "additionalProperties": False},
    "anyof": {"type": "object", "properties": {"value": {"anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 100}, {"type": "boolean"},
        {"type": "string", "maxLength": 4}]}}, "required": ["value"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {
        "email": {"type": "string", "pattern": "^[a-z]{2,6}@[a-z]{2,6}\\.(com|org)$"},
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["email", "code"], "additionalProperties": False},
    "optional-fields": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999}, "nickname": NAME,
        "tags": {"type": "array", "items": NAME, "maxItems": 2}},
        "required": ["id"], "additionalProperties": False},
    "array-of-objects": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5},
                                         "y": {"type": "boolean"}},
        "required": ["x", "y"], "additionalProperties": False}},
    "const-and-null": {"type": "object", "properties": {"kind": {"const": "point"},
                                                        "label": {"type": ["string", "null"],
                                                                  "maxLength": 3}},
                       "required": ["kind", "label"], "additionalProperties": False},
    "boolean-and-string-enum-array": {"type": "object", "properties": {
        "ok": {"type": "boolean"},
        "levels": {"type": "array", "items": {"enum": ["low", "high"]}, "minItems": 1,
                   "maxItems": 3}},
        "required": ["ok", "levels"], "additionalProperties": False},
    "defs-and-ref": {"$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"],
        "additionalProperties": False}}, "type": "object",
        "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"], "additionalProperties": False},
}


@pytest.fixture(scope="module")
def llm(checkpoint):
    return make_llm(checkpoint("tiny", std=0.08), max_model_len=512, kv_cache_memory=32 << 20)


def constrained(max_tokens: int = 200, temperature: float = 0.0, seed: int | None = None,
                **structured) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**structured))


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_outputs_validate_against_the_schema(llm, name):
    schema = SCHEMAS[name]
    greedy = constrained(json=schema, disable_any_whitespace=True)
    sampled = constrained(json=json.dumps(schema), disable_any_whitespace=True, temperature=1.0,
                          seed=7)
    for out in llm.generate([PROMPT, PROMPT], [greedy, sampled], use_tqdm=False):
        assert out.finish_reason == "stop", out.text  # the grammar completed
        jsonschema.validate(json.loads(out.text), schema)


def test_unconstrained_json_is_not_valid(llm):
    """(The check above can fail: the same model without the constraint writes no JSON.)"""
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0]
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_regex_choice_and_grammar(llm):
    regex = r"[a-z]{3,6}@[a-z]{2,5}\.(com|org)"
    choices = ["yes", "no", "maybe later"]
    gbnf = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
    lark = 'start: "[" WORD ("," WORD)~0..2 "]"\nWORD: /[a-z]{1,4}/'
    outs = llm.generate([PROMPT] * 4, [constrained(regex=regex), constrained(choice=choices),
                                       constrained(grammar=gbnf), constrained(grammar=lark)],
                        use_tqdm=False)
    assert all(o.finish_reason == "stop" for o in outs), [o.text for o in outs]
    assert re.fullmatch(regex, outs[0].text)
    assert outs[1].text in choices
    assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", outs[2].text)
    assert re.fullmatch(r"\[[a-z]{1,4}(,[a-z]{1,4}){0,2}\]", outs[3].text)
    # the answer ends when the grammar does: no end-of-text token was needed
    assert not set(outs[1].token_ids) & llm.llm_engine.eos_token_ids


def test_a_tiny_temperature_keeps_to_the_grammar(llm):
    """A temperature of 8e-40 (the fuzz test's pick) made logits / temperature overflow and the
    softmax NaN: a token outside the grammar was drawn and the step failed. It samples at vLLM's
    floor, 0.01, instead."""
    choices = ["yes", "no", "maybe later"]
    params = SamplingParams(temperature=8e-40, top_p=0.25, max_tokens=10,
                            structured_outputs=StructuredOutputsParams(choice=choices))
    assert params.temperature == 0.01
    outs = llm.generate([PROMPT] * 3, params, use_tqdm=False)
    assert all(o.outputs[0].text in choices for o in outs)


def test_json_object(llm):
    out = llm.generate([PROMPT], constrained(json_object=True, disable_any_whitespace=True,
                                             max_tokens=400), use_tqdm=False)[0]
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:  # an unbounded object may run to max_tokens; it is still a JSON object's prefix
        assert out.text.startswith("{")


def test_unconstrained_rows_are_unchanged_by_constrained_ones_in_the_batch(llm):
    free = SamplingParams(temperature=0, max_tokens=24)
    seeded = SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=24)
    alone = llm.generate([PROMPT, "Another prompt"], [free, seeded], use_tqdm=False)
    mixed = llm.generate([PROMPT, "Another prompt", PROMPT, PROMPT],
                         [free, seeded, constrained(json=SCHEMAS["flat"],
                                                    disable_any_whitespace=True),
                          constrained(choice=["a", "b"])], use_tqdm=False)
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone]


def test_seeds_n_and_preemption(llm, checkpoint):
    params = SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=200,
                            structured_outputs=StructuredOutputsParams(
                                json=SCHEMAS["optional-fields"], disable_any_whitespace=True))
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), SCHEMAS["optional-fields"])
    batched = llm.generate([PROMPT, "x y z"], [params, SamplingParams(max_tokens=30)],
                           use_tqdm=False)[0]
    assert [c.token_ids for c in batched.outputs] == [c.token_ids for c in out.outputs]
    # a KV cache too small for all of them at once: sequences are preempted and recomputed,
    # their grammars keep their place
    # (room for 96 tokens, 1 KiB each in this model; 18 sequences of about 50)
    small = make_llm(checkpoint("tiny", std=0.08), max_model_len=96, kv_cache_memory=96 << 10,
                     block_size=4)
    outs = small.generate([PROMPT] * 6, [params] * 6, use_tqdm=False)
    assert small.llm_engine.scheduler.num_preemptions > 0
    for o in outs:
        assert [c.token_ids for c in o.outputs] == [c.token_ids for c in out.outputs]


def test_logprobs_are_those_of_the_masked_distribution(llm):
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    tokenizer, engine = llm.get_tokenizer(), llm.llm_engine
    # the first tokens the grammar allows: "yes" and "no" and their prefixes ("y", "ye", "n")
    state = engine.grammar_compiler.new_state(params.structured_outputs, [1])
    mask = apply_bitmasks(torch.zeros(1, engine.config.vocab_size), [state.bitmask()])
    allowed = set(torch.isfinite(mask[0]).nonzero().flatten().tolist())
    assert {tokenizer.decode([t]) for t in allowed} == {"y", "ye", "yes", "n", "no"}
    top = out.logprobs[0]
    finite = {t: lp.logprob for t, lp in top.items() if math.isfinite(lp.logprob)}
    assert set(finite) <= allowed and out.token_ids[0] in allowed
    assert sum(math.exp(v) for v in finite.values()) == pytest.approx(1.0, abs=1e-5)


def test_thinking_first_then_the_constraint(llm):
    """With thinking on the chat template ends at the assistant header: the reasoning is free up
    to </think>; with thinking off the template closes the think block and the constraint starts
    at the first token."""
    engine, tokenizer = llm.llm_engine, llm.get_tokenizer()
    messages = [{"role": "user", "content": PROMPT}]
    params = StructuredOutputsParams(choice=["yes", "no"])
    thinking = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             enable_thinking=True)
    state = engine.grammar_compiler.new_state(params, thinking)
    assert state.reasoning and state.bitmask() is None
    for token in tokenizer.encode("<think>\nhmm\n"):
        state.accept(token)
    assert state.bitmask() is None
    state.accept(tokenizer.token_to_id("</think>"))
    assert not state.reasoning
    allowed = apply_bitmasks(torch.zeros(1, engine.config.vocab_size), [state.bitmask()])
    allowed = torch.isfinite(allowed[0]).nonzero().flatten().tolist()
    assert {tokenizer.decode([t]) for t in allowed} == {"y", "ye", "yes", "n", "no"}
    plain = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                          enable_thinking=False)
    out = llm.generate([plain], SamplingParams(temperature=0, max_tokens=8,
                                               structured_outputs=params), use_tqdm=False)[0]
    assert out.text in ("yes", "no")
    assert not engine.grammar_compiler.new_state(params, plain).reasoning


def test_apply_bitmasks_reads_bit_i_of_word_j_as_token_32j_plus_i():
    vocab = 70
    words = torch.zeros(3, dtype=torch.int32)  # ceil(70 / 32) words
    for token in (0, 31, 32, 69):
        words[token // 32] |= torch.tensor(1 << (token % 32)).to(torch.int32)
    logits = torch.randn(2, vocab)
    out = apply_bitmasks(logits, [None, words])
    assert torch.equal(out[0], logits[0])  # an unconstrained row is untouched
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [0, 31, 32, 69]
    assert torch.equal(out[1][[0, 31, 32, 69]], logits[1][[0, 31, 32, 69]])
    assert apply_bitmasks(logits, [None, None]) is logits


@pytest.mark.parametrize("structured, message", [
    (dict(json={"type": "nonsense"}), "json cannot be compiled"),
    (dict(json={"type": "string", "format": "weird"}), "Unknown format: weird"),
    (dict(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
    (dict(json="{not json"), "the json is invalid"),
    (dict(regex="[a-z]+("), "unclosed group"),
    (dict(grammar="start: undefined_rule"), "undefined_rule"),
])
def test_bad_constraints_are_clear_errors(llm, structured, message):
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate([PROMPT], constrained(**structured), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    # and the engine keeps serving
    out = llm.generate([PROMPT], constrained(choice=["ok"]), use_tqdm=False)[0]
    assert out.text == "ok"


def test_params_name_the_mistake():
    with pytest.raises(InvalidRequestError, match="exactly one of .*got json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(InvalidRequestError, match="exactly one of .*got none"):
        StructuredOutputsParams()
    with pytest.raises(InvalidRequestError, match="choice=.*non-empty list of strings"):
        StructuredOutputsParams(choice=["a", 1])
    with pytest.raises(InvalidRequestError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})


@pytest.fixture(scope="module")
def whitespace_lover(checkpoint):
    """The test model with an LM-head bias that puts every whitespace-only token far ahead of the rest: a model that
    would rather write whitespace than anything else."""
    llm = make_llm(checkpoint("tiny", std=0.08), max_model_len=512, kv_cache_memory=32 << 20)
    tokenizer = llm.get_tokenizer()
    model = llm.llm_engine.model
    vocab = model.config.vocab_size
    spaces = [t for t in range(tokenizer.vocab_size) if (text := tokenizer.decode([t])) and not text.strip()]
    bias = torch.zeros(vocab)
    bias[spaces] = 50.0
    model.lm_head.bias = torch.nn.Parameter(bias, requires_grad=False)
    return llm


@pytest.mark.parametrize("name", ["nested", "anyof", "array-of-objects", "optional-fields"])
def test_json_spends_no_answer_on_whitespace(whitespace_lover, name):
    """With the whitespace a JSON grammar allows bounded (JSON_WHITESPACE, llama.cpp's rule), a model that prefers
    whitespace still completes valid JSON in a small budget, greedy and sampled, with whitespace between its tokens;
    with any amount allowed it wrote newlines and tabs until max_tokens."""
    schema = SCHEMAS[name]
    free = whitespace_lover.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert free.text.strip() == ""  # the bias works: unconstrained, nothing but whitespace
    params = [constrained(json=schema, max_tokens=120), constrained(json=schema, max_tokens=120, temperature=1.0,
                                                                    seed=3)]
    for out in whitespace_lover.generate([PROMPT, PROMPT], params, use_tqdm=False):
        assert out.finish_reason == "stop", repr(out.text)
        jsonschema.validate(json.loads(out.text), schema)
        assert re.search(r"\n[ \t]+", out.text)  # it did write whitespace: only as much as allowed
        assert all(len(run) <= 22 for run in re.findall(r"\s+", re.sub(r'"(\\.|[^"\\])*"', '""', out.text)))


def test_json_object_whitespace_is_bounded(whitespace_lover):
    out = whitespace_lover.generate([PROMPT], constrained(json_object=True, max_tokens=60), use_tqdm=False)[0]
    # an unbounded object may not end, but its first key comes after at most one bounded run of whitespace
    assert re.match(r'\{(?:[ ]?|\n{1,2}[ \t]{0,20})(\}|")', out.text), repr(out.text)
