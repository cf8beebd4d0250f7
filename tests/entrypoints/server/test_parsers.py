"""The chat response parsers (nanoqwen/entrypoints/server/parsers.py) on crafted text: reasoning (<think>)
and tool calls (<tool_call>), whole and split into stream deltas at every point. No server."""

from __future__ import annotations

import json
import re

import pytest
from conftest import CALLS, THOUGHT

from nanoqwen.entrypoints.server.parsers import ChatOutputParser, ReasoningParser, ToolCallParser


def feed_in_pieces(parser: ChatOutputParser, text: str,
                   cuts: list[int]) -> tuple[str, str, list]:
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    parts = [parser.feed(p) for p in pieces] + [parser.finish()]
    return ("".join(p[0] for p in parts), "".join(p[1] for p in parts),
            [c for p in parts for c in p[2]])


@pytest.mark.parametrize("text,reasoning,content", [
    ("<think>\nHmm.\n</think>\n\nHello!", "\nHmm.\n", "\n\nHello!"),
    ("\n<think>a</think>b", "a", "b"),
    # only an opening <think> starts reasoning
    ("Hello <think>x</think>", "", "Hello <think>x</think>"),
    ("<think>cut off by max_tok", "cut off by max_tok", ""),
    ("<thi", "", "<thi"),
    ("plain", "", "plain"),
    ("<think></think>", "", ""),
])
def test_reasoning_parser_whole_and_split_at_every_point(text, reasoning, content):
    for cut in range(len(text) + 1):
        # two pieces at every point; one character at a time
        for cuts in ([cut], list(range(1, len(text)))):
            parser = ChatOutputParser(reasoning=True, in_reasoning=False, tools=False)
            got = feed_in_pieces(parser, text, cuts)
            assert got == (reasoning, content, []), (cuts, got)


def test_reasoning_parser_when_the_prompt_opened_think():
    p = ReasoningParser(in_reasoning=True)
    assert p.feed("thinking</th") == ("thinking", "") and p.feed("ink>answer") == ("", "answer")


def test_tool_call_parser_split_at_every_point():
    text = THOUGHT + CALLS
    for cut in range(len(text) + 1):
        reasoning, content, calls = feed_in_pieces(ChatOutputParser(True, False, True), text, [cut])
        assert reasoning == "\nThe user wants the weather.\n" and content == ""
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("get_weather", {"city": "Paris"}), ("get_time", {})]
        assert (all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in calls)
                and calls[0].id != calls[1].id)


@pytest.mark.parametrize("text,content,names", [
    ("<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    ('<tool_call>{"name": "f", "arguments": "x"}</tool_call>',
     '<tool_call>{"name": "f", "arguments": "x"}</tool_call>', []),
    ('Let me check. <tool_call>{"name": "f"}</tool_call>', "Let me check.", ["f"]),
    ('<tool_call>{"name": "f"}</tool_call>\nDone. \n', "Done.", ["f"]),
    # unclosed
    ('<tool_call>{"name": "f", "arguments": {}}', '<tool_call>{"name": "f", "arguments": {}}', []),
    ("a <tool_ b", "a <tool_ b", []),
    ("no calls\n", "no calls\n", []),
])
def test_tool_call_parser_keeps_malformed_calls_as_text(text, content, names):
    for cut in range(len(text) + 1):
        p = ToolCallParser()
        got, calls = p.feed(text[:cut])
        more, calls2 = p.feed(text[cut:])
        assert (got + more + p.finish(), [c.name for c in calls + calls2]) == (content, names)
