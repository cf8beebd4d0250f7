"""The `nanoqwen` command run for real (init-random, generate, chat), and the chat printing
helpers."""

from __future__ import annotations

import copy
import io
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nanoqwen import LLM, SamplingParams
from nanoqwen.chat import AnswerPrinter, answer, chat_loop

PROMPT = "Hello, my name is"
STATS = re.compile(r"^\[prefill (\d+) tokens in \d+\.\d\ds · "
                   r"decode (\d+) tokens at \d+\.\d tok/s\]$", re.M)
# Same thread count as this process, so the subprocess computes bit for bit what the in-process
# LLM does.
ENV = {**os.environ, "PYTHONIOENCODING": "utf-8", "OMP_NUM_THREADS": str(torch.get_num_threads()),
       "HF_HUB_OFFLINE": "1"}


def run_cli(*args: str, stdin: str = "") -> SimpleNamespace:
    """Run `python -m nanoqwen.cli ARGS`; stdout/stderr decoded as UTF-8 without newline
    translation."""
    r = subprocess.run([sys.executable, "-m", "nanoqwen.cli", *args], input=stdin.encode(),
                       capture_output=True, env=ENV, timeout=120)
    return SimpleNamespace(returncode=r.returncode, stdout=r.stdout.decode("utf-8"),
                           stderr=r.stderr.decode("utf-8", errors="replace"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "tiny"
    # std 0.3: peaked random logits, so greedy never hinges on a near-tie
    r = run_cli("init-random", str(path), "--preset", "tiny", "--std", "0.3")
    assert r.returncode == 0, r.stderr
    assert f"wrote a random-weight tiny model to {path}" in r.stdout
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()
    return path


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, dtype="float32", device="cpu", max_model_len=256)


GREEDY8 = SamplingParams(temperature=0, max_tokens=8)


def test_generate_raw_prompt_equals_llm_generate(model_dir, llm):
    r = run_cli("generate", "--model", str(model_dir), "--prompt", PROMPT, "--max-tokens", "8",
                "--temperature", "0", "--no-chat-template", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    expected = llm.generate(PROMPT, GREEDY8, use_tqdm=False)[0]
    assert len(expected.token_ids) == 8 and expected.text.strip()
    assert r.stdout == expected.text + "\n"
    assert "Traceback" not in r.stderr


def test_generate_prompt_from_stdin_with_the_default_dtype(model_dir):
    r = run_cli("generate", "--model", str(model_dir), "--prompt", "-", "--max-tokens", "8",
                "--temperature", "0", "--no-chat-template", "--device", "cpu", stdin=PROMPT)
    assert r.returncode == 0, r.stderr
    # dtype auto: bfloat16 on CPU, as in the CLI
    default = LLM(model_dir, device="cpu", max_model_len=64)
    assert default.llm_engine.model.embed_tokens.weight.dtype == torch.bfloat16
    expected = default.generate(PROMPT, GREEDY8, use_tqdm=False)[0].text
    assert expected.strip() and r.stdout == expected + "\n"


def test_generate_with_chat_template(model_dir, llm):
    r = run_cli("generate", "--model", str(model_dir), "--prompt", PROMPT, "--max-tokens", "8",
                "--temperature", "0", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    expected = llm.chat([{"role": "user", "content": PROMPT}], GREEDY8, enable_thinking=True,
                        use_tqdm=False)[0]
    assert expected.text.strip() and r.stdout == expected.text + "\n"
    raw = llm.generate(PROMPT, GREEDY8, use_tqdm=False)[0].text
    assert expected.text != raw  # the template was applied


def test_chat_session(model_dir, llm):
    script = "hello\n/no_think\nhi again\n/reset\n/exit\n"
    r = run_cli("chat", "--model", str(model_dir), "--max-tokens", "8", "--temperature", "0",
                "--dtype", "float32", stdin=script)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    out = r.stdout
    assert out.startswith("nanoqwen chat · thinking on\n")
    assert out.index("thinking off") < out.index("conversation cleared")
    stats = STATS.findall(out)
    assert len(stats) == 2, out  # one line per answer
    assert all(decoded == "8" for _, decoded in stats)

    # The prompts the chat built: turn 1 with thinking, turn 2 (after /no_think) with the history,
    # thinking off.
    tok = llm.get_tokenizer()
    turn1 = [{"role": "user", "content": "hello"}]
    reply = llm.chat(turn1, GREEDY8, enable_thinking=True, use_tqdm=False)[0].text
    turn2 = [*turn1, {"role": "assistant", "content": reply},
             {"role": "user", "content": "hi again"}]
    assert int(stats[0][0]) == len(tok.apply_chat_template(turn1, tokenize=True,
                                                           enable_thinking=True))
    assert int(stats[1][0]) == len(tok.apply_chat_template(turn2, tokenize=True,
                                                           enable_thinking=False))
    assert int(stats[1][0]) != len(tok.apply_chat_template(turn2, tokenize=True,
                                                           enable_thinking=True))


def test_unknown_preset_is_an_argparse_error(tmp_path):
    r = run_cli("init-random", str(tmp_path / "m"), "--preset", "qwen3-huge")
    assert r.returncode == 2
    assert "invalid choice: 'qwen3-huge'" in r.stderr and "tiny" in r.stderr
    assert not (tmp_path / "m").exists()


# ---------------------------------------------------------------- AnswerPrinter

THOUGHT = "<think>\nreasoning</think>\n\nanswer"


def printed(pieces: list[str], tty: bool = False) -> str:
    out = TTY() if tty else io.StringIO()
    printer = AnswerPrinter(out)
    for piece in pieces:
        printer.write(piece)
    printer.finish()
    return out.getvalue()


class TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def chunkings(text: str) -> list[list[str]]:
    """Every split into two pieces, one char at a time, the real token pieces, and random small
    pieces."""
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    splits += [list(text), ["<think>", "\n", "reason", "ing", "</think>", "\n\n", "answer"]]
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(2, 12)))
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return splits


def test_answer_printer_labels_the_thinking_part_in_any_pieces():
    for pieces in chunkings(THOUGHT):
        out = printed(pieces)
        assert "<think>" not in out and "</think>" not in out, pieces
        assert out.count("[thinking]") == 1 and out.count("[/thinking]") == 1, (pieces, out)
        assert (out.index("[thinking]") < out.index("reasoning") < out.index("[/thinking]")
                < out.index("answer"))
        assert out.replace("\n", "") == "[thinking]reasoning[/thinking]answer", (pieces, out)
        assert out.endswith("answer\n")


def test_answer_printer_output_does_not_depend_on_the_pieces():
    whole = printed([THOUGHT])
    for pieces in chunkings(THOUGHT):
        assert printed(pieces) == whole, pieces


def test_answer_printer_passes_other_text_through():
    assert printed(["plain ", "answer"]) == "plain answer\n"
    # held back, then not a tag after all
    assert printed(["x <", "thing> <th", "ink"]) == "x <thing> <think\n"
    assert printed(["a < b"]) == "a < b\n"
    unfinished = printed(["<think>\nstill thinking"])  # the thinking part is closed at the end
    assert (unfinished.startswith("[thinking]\nstill thinking\n[/thinking]\n")
            and unfinished.strip().endswith("]"))


def test_answer_printer_dims_thinking_on_a_terminal():
    out = printed(["<thi", "nk>\nhm</th", "ink>\n\nyes"], tty=True)
    assert "[thinking]" not in out and "<think>" not in out
    assert out.index("\033[2m") < out.index("hm") < out.index("\033[0m") < out.index("yes")


# --------------------------------------------------------- answer() and chat_loop() with a fake LLM


class FakeTokenizer:
    def __init__(self) -> None:
        self.calls: list[tuple[list[dict], bool]] = []

    def apply_chat_template(self, messages, tokenize=False, enable_thinking=True, **kwargs):
        self.calls.append((copy.deepcopy(messages), enable_thinking))
        return [1, 2, 3, 4, 5]


class FakeLLM:
    """What chat.answer uses of an LLM: get_tokenizer() and stream(prompt, params)."""

    def __init__(self, deltas: list[str], interrupt_after: int | None = None) -> None:
        self.deltas, self.interrupt_after = deltas, interrupt_after
        self.tokenizer = FakeTokenizer()
        self.closed = False

    def get_tokenizer(self) -> FakeTokenizer:
        return self.tokenizer

    def stream(self, prompt, params):
        text = ""
        try:
            for i, delta in enumerate(self.deltas):
                if i == self.interrupt_after:
                    raise KeyboardInterrupt  # Ctrl-C while the engine computes the next token
                text += delta
                yield delta, SimpleNamespace(text=text, token_ids=list(range(i + 1)),
                                             finished=False)
        finally:
            self.closed = True


def no_interrupt_escapes(*args) -> str:
    """answer(*args), failing the test (instead of stopping pytest) if Ctrl-C escapes it."""
    try:
        return answer(*args)
    except KeyboardInterrupt:
        pytest.fail("answer() let KeyboardInterrupt escape")


def test_ctrl_c_returns_partial_text_and_prints_stopped():
    llm = FakeLLM(["Hello", " wor", "ld"], interrupt_after=2)
    out = io.StringIO()
    text = no_interrupt_escapes(llm, [{"role": "user", "content": "hi"}], GREEDY8, True, out)
    assert text == "Hello wor"
    assert llm.closed
    printed_out = out.getvalue()
    assert printed_out.startswith("Hello wor\n[stopped]\n")
    assert [m.groups() for m in STATS.finditer(printed_out)] == [("5", "2")]


def test_ctrl_c_while_thinking_closes_the_thinking_part():
    out = io.StringIO()
    llm = FakeLLM(["<think>", "\nhmm", " more"], interrupt_after=2)
    text = no_interrupt_escapes(llm, [{"role": "user", "content": "q"}], GREEDY8, True, out)
    assert text == "<think>\nhmm"
    assert out.getvalue().startswith("[thinking]\nhmm\n[/thinking]\n\n[stopped]\n")


def test_ctrl_c_before_the_first_token_prints_no_stats():
    out = io.StringIO()
    llm = FakeLLM(["never"], interrupt_after=0)
    assert no_interrupt_escapes(llm, [{"role": "user", "content": "q"}], GREEDY8, True, out) == ""
    assert out.getvalue() == "\n[stopped]\n"


def test_ctrl_c_in_a_real_stream_frees_the_request(llm, monkeypatch):
    engine = llm.llm_engine
    real_step, calls = engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    messages = [{"role": "user", "content": "hello"}]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    out = io.StringIO()
    partial = no_interrupt_escapes(llm, messages, params, True, out)
    assert "[stopped]" in out.getvalue()
    assert not engine.has_unfinished_requests()  # the interrupted request left the engine
    monkeypatch.undo()
    full = llm.chat(messages, params, enable_thinking=True, use_tqdm=False)[0]
    assert (len(full.token_ids) == 20 and full.text.startswith(partial)
            and len(partial) < len(full.text))
    assert STATS.search(out.getvalue()).group(2) == "2"  # two tokens made it out before Ctrl-C


def test_chat_loop_switches_thinking_and_resets():
    llm = FakeLLM(["<think>\nok</think>", "\n\n", "fine"])
    inp = io.StringIO("hello\n/no_think\nhi again\n/think\n\nthird\n/reset\nfourth\n/bogus\n")
    out = io.StringIO()
    # returns at EOF
    chat_loop(llm, GREEDY8, enable_thinking=True, system="be brief", inp=inp, out=out)
    reply = "<think>\nok</think>\n\nfine"
    system = {"role": "system", "content": "be brief"}
    turn1 = [system, {"role": "user", "content": "hello"}]
    turn2 = [*turn1, {"role": "assistant", "content": reply},
             {"role": "user", "content": "hi again"}]
    turn3 = [*turn2, {"role": "assistant", "content": reply}, {"role": "user", "content": "third"}]
    turn4 = [system, {"role": "user", "content": "fourth"}]
    assert llm.tokenizer.calls == [(turn1, True), (turn2, False), (turn3, True), (turn4, True)]
    text = out.getvalue()
    assert (text.index(">>> thinking off\n") < text.index(">>> thinking on\n")
            < text.index(">>> conversation cleared"))
    assert "unknown command /bogus" in text
    assert len(STATS.findall(text)) == 4


def test_chat_loop_exit_command():
    llm = FakeLLM(["x"])
    out = io.StringIO()
    chat_loop(llm, GREEDY8, inp=io.StringIO("/exit\nhello\n"), out=out)
    assert llm.tokenizer.calls == []  # nothing after /exit was read
