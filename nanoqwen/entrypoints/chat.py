"""`nanoqwen chat`: a multi-turn conversation in the terminal, streamed token by token.

Commands: /think and /no_think switch thinking on or off for the next turns (Qwen3 also reads
a trailing /think or /no_think inside a message as a per-turn soft switch; such messages go to
the model unchanged), /reset forgets the conversation, /exit (or Ctrl-D) quits. Ctrl-C stops
the answer being generated and keeps the program running.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from nanoqwen.entrypoints.llm import LLM
from nanoqwen.lora.request import LoRARequest
from nanoqwen.outputs import speed_summary
from nanoqwen.sampling_params import SamplingParams

THINK_START, THINK_END = "<think>", "</think>"
HELP = "Commands: /think  /no_think  /reset  /exit  (Ctrl-C stops an answer, Ctrl-D quits)"


class AnswerPrinter:
    """Prints streamed text, showing the <think>…</think> part dimmed (or labelled when not a
    terminal).

    Newlines around the tags are the model's formatting of the template
    ("<think>\n…\n</think>\n\n"), so they are dropped at the start and end of each part, however
    the text is split into pieces.
    """

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.color = out.isatty()
        self.thinking = False
        self.pending = ""  # text that might be the start of a tag
        self.newlines = ""  # trailing newlines, printed only if more text follows in this part
        self.part_started = False

    def write(self, text: str) -> None:
        text = self.pending + text
        self.pending = ""
        while text:
            tag = THINK_END if self.thinking else THINK_START
            i = text.find(tag)
            if i < 0:
                keep = _partial_tag_suffix(text, tag)
                self._emit(text[: len(text) - keep])
                self.pending = text[len(text) - keep:]
                return
            self._emit(text[:i])
            self._switch()
            text = text[i + len(tag):]

    def finish(self) -> None:
        self._emit(self.pending)
        self.pending = ""
        if self.thinking:
            self._switch()
        self.out.write("\n")
        self.out.flush()

    def _emit(self, text: str) -> None:
        if not self.part_started:
            text = text.lstrip("\n")
        body = text.rstrip("\n")
        if body:
            self.out.write(self.newlines + body)
            self.out.flush()
            self.part_started = True
            self.newlines = ""
        self.newlines += text[len(body):]

    def _switch(self) -> None:
        self.thinking = not self.thinking
        self.newlines, self.part_started = "", False
        if self.color:
            self.out.write("\033[2m" if self.thinking else "\033[0m\n")
        else:
            self.out.write("[thinking]\n" if self.thinking else "\n[/thinking]\n")


def _partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a beginning of `tag` (held back until it is
    decided)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def answer(llm: LLM, messages: list[dict], params: SamplingParams, enable_thinking: bool,
           out: TextIO = sys.stdout, lora_request: LoRARequest | None = None) -> str:
    """Stream one assistant answer to `out` (with the LoRA adapter lora_request, if any), print timing, and return
    its text (partial if interrupted)."""
    prompt = llm.get_tokenizer().apply_chat_template(messages, tokenize=True,
                                                     enable_thinking=enable_thinking)
    printer = AnswerPrinter(out)
    start = time.perf_counter()
    first = None
    text, num_tokens = "", 0
    try:
        for delta, output in llm.stream(prompt, params, lora_request=lora_request):
            first = first or time.perf_counter()
            printer.write(delta)
            text, num_tokens = output.text, len(output.token_ids)
    except KeyboardInterrupt:
        printer.finish()
        out.write("[stopped]\n")
    else:
        printer.finish()
    end = time.perf_counter()
    if first is not None:
        out.write(f"[{speed_summary(len(prompt), first - start, num_tokens, end - first)}]\n")
    return text


def chat_loop(llm: LLM, params: SamplingParams, enable_thinking: bool = True,
              system: str | None = None, inp: TextIO = sys.stdin,
              out: TextIO = sys.stdout, lora_request: LoRARequest | None = None) -> None:
    messages: list[dict] = [{"role": "system", "content": system}] if system else []
    out.write(f"nanoqwen chat · thinking {'on' if enable_thinking else 'off'}\n{HELP}\n")
    while True:
        out.write(">>> ")
        out.flush()
        try:
            line = inp.readline()
        except KeyboardInterrupt:
            out.write("\n(use /exit or Ctrl-D to quit)\n")
            continue
        if not line:  # EOF
            out.write("\n")
            return
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit", "/bye"):
            return
        if line in ("/think", "/no_think"):
            enable_thinking = line == "/think"
            out.write(f"thinking {'on' if enable_thinking else 'off'}\n")
            continue
        if line == "/reset":
            messages = messages[:1] if system else []
            out.write("conversation cleared\n")
            continue
        if line.startswith("/") and " " not in line:
            out.write(f"unknown command {line}. {HELP}\n")
            continue
        messages.append({"role": "user", "content": line})
        reply = answer(llm, messages, params, enable_thinking, out, lora_request)
        messages.append({"role": "assistant", "content": reply})
