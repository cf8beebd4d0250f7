"""Qwen3's reasoning (<think>...</think>) and hermes-style tool calls
(<tool_call>{json}</tool_call>), parsed incrementally from the generated text.

Both parsers are streaming state machines: feed() takes each new piece of text and returns what is
final so far; finish() flushes what was held back. A whole answer is parsed by one feed() and one
finish(), so a non-streamed response is exactly the concatenation of the streamed deltas. Text that
may be the start of a tag (e.g. "</thi") is held back until the next delta decides it, so tags
split across deltas work.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

THINK_START, THINK_END = "<think>", "</think>"
TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (0 if none)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningParser:
    """Splits Qwen3 output into reasoning_content (inside <think>...</think>) and content, as vLLM's
    qwen3 parser does: a <think> that opens the answer starts reasoning, </think> ends it, and text
    after it is content. Nothing is stripped, so the two parts plus the tags are the raw output.

    in_reasoning=True starts inside the block: for templates whose generation prompt already ends
    with <think> (Qwen3 *-Thinking-2507), the model only emits the closing tag. An answer that ends
    before </think> (e.g. cut by max_tokens) is all reasoning, in streams and whole responses alike.
    """

    def __init__(self, in_reasoning: bool = False) -> None:
        # "detect": only whitespace so far, a <think> may still open; then "reasoning" or "content".
        self.mode = "reasoning" if in_reasoning else "detect"
        self.buffer = ""

    def feed(self, delta: str) -> tuple[str, str]:
        """Return (reasoning, content) that became final with this delta."""
        self.buffer += delta
        reasoning, content = "", ""
        while True:
            if self.mode == "detect":
                head = self.buffer.lstrip()
                if head.startswith(THINK_START):
                    self.mode, self.buffer = "reasoning", head[len(THINK_START):]
                elif THINK_START.startswith(head):
                    return reasoning, content  # whitespace or a partial "<thi": undecided
                else:
                    self.mode = "content"
            elif self.mode == "reasoning":
                end = self.buffer.find(THINK_END)
                if end < 0:
                    keep = _partial_tag_len(self.buffer, THINK_END)
                    reasoning += self.buffer[:len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return reasoning, content
                reasoning += self.buffer[:end]
                self.mode, self.buffer = "content", self.buffer[end + len(THINK_END):]
            else:
                content, self.buffer = content + self.buffer, ""
                return reasoning, content

    def finish(self) -> tuple[str, str]:
        """Flush what was held back: a partial tag at the end is plain text of its part."""
        rest, self.buffer = self.buffer, ""
        return (rest, "") if self.mode == "reasoning" else ("", rest)


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as a string (what OpenAI clients expect)
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_dict(self, index: int | None = None) -> dict:
        function = {"name": self.name, "arguments": self.arguments}
        out = {"id": self.id, "type": "function", "function": function}
        return out if index is None else {"index": index, **out}


def parse_tool_call(raw: str) -> ToolCall | None:
    """{"name": ..., "arguments": {...}} -> ToolCall; None for anything else (it then stays
    text)."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolCallParser:
    """Turns complete <tool_call>{json}</tool_call> blocks into ToolCalls
    (vLLM's hermes parser format).

    A block whose JSON is malformed, or that never closes, stays in the content as text. Whitespace
    around calls (the newlines Qwen3 puts between them) and at the end of an answer that made calls
    is dropped rather than sent as content.
    """

    def __init__(self) -> None:
        self.buffer = ""
        self.in_call = False
        # trailing whitespace outside calls, held until we know if it is content
        self.pending_space = ""
        self.num_calls = 0
        self.after_call = False

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """Return (content, tool calls) that became final with this delta."""
        self.buffer += delta
        content, calls = "", []
        while True:
            if not self.in_call:
                start = self.buffer.find(TOOL_START)
                if start < 0:
                    keep = _partial_tag_len(self.buffer, TOOL_START)
                    content += self._text(self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return content, calls
                content += self._text(self.buffer[:start])
                self.in_call, self.buffer = True, self.buffer[start + len(TOOL_START):]
            else:
                end = self.buffer.find(TOOL_END)
                if end < 0:
                    return content, calls  # the block is still arriving
                raw, self.buffer = self.buffer[:end], self.buffer[end + len(TOOL_END):]
                self.in_call = False
                call = parse_tool_call(raw)
                if call is None:
                    content += self._text(TOOL_START + raw + TOOL_END)
                else:
                    self.pending_space, self.after_call = "", True
                    self.num_calls += 1
                    calls.append(call)

    def finish(self) -> str:
        """Flush: an unclosed block or a partial tag at the end is content."""
        rest = (TOOL_START if self.in_call else "") + self.buffer
        self.buffer, self.in_call = "", False
        content = self._text(rest)
        if self.num_calls == 0:
            content += self.pending_space
        self.pending_space = ""
        return content

    def _text(self, text: str) -> str:
        # Trailing whitespace waits: dropped if a tool call comes next, sent if more text does.
        text = self.pending_space + text
        if self.after_call:  # and whitespace right after a call is dropped
            text = text.lstrip()
            self.after_call = not text
        body = text.rstrip()
        self.pending_space = text[len(body):]
        return body


class ChatOutputParser:
    """One answer's text -> (reasoning, content, tool calls): the reasoning parser first (if
    thinking is on), then the tool-call parser on the content (if tools are on)."""

    def __init__(self, reasoning: bool, in_reasoning: bool, tools: bool) -> None:
        self.reasoning = ReasoningParser(in_reasoning) if reasoning else None
        self.tools = ToolCallParser() if tools else None
        self.tool_calls: list[ToolCall] = []

    def feed(self, delta: str) -> tuple[str, str, list[ToolCall]]:
        reasoning, content = self.reasoning.feed(delta) if self.reasoning else ("", delta)
        return (reasoning, *self._content(content, final=False))

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        return (reasoning, *self._content(content, final=True))

    def parse(self, text: str) -> tuple[str, str, list[ToolCall]]:
        """A whole answer at once (the same result as streaming it)."""
        parts = [self.feed(text), self.finish()]
        reasoning, content = "".join(p[0] for p in parts), "".join(p[1] for p in parts)
        return reasoning, content, [c for p in parts for c in p[2]]

    def _content(self, content: str, final: bool) -> tuple[str, list[ToolCall]]:
        if self.tools is None:
            return content, []
        content, calls = self.tools.feed(content)
        if final:
            content += self.tools.finish()
        self.tool_calls += calls
        return content, calls
