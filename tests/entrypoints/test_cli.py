"""The `nanoqwen` command run for real (init-random, generate, chat), and the chat printing
helpers."""

from __future__ import annotations

import copy
import io
import random
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import run_cli

from nanoqwen import LLM, SamplingParams
from nanoqwen.entrypoints.chat import AnswerPrinter, answer, chat_loop

PROMPT = "Hello, my name is"
STATS = re.compile(r"^\[prefill (\d+) tokens in \d+\.\d\ds · "
                   r"decode (\d+) tokens at \d+\.\d tok/s\]$", re.M)
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


def test_generate_closes_with_one_short_speed_line(model_dir):
    """generate's stderr is one line: prompt tokens and prefill time, tokens and tok/s, the weights; what the
    engine chose to compute with goes to the log, shown with --verbose."""
    args = ("generate", "--model", str(model_dir), "--prompt", PROMPT, "--max-tokens", "4", "--temperature", "0",
            "--dtype", "bfloat16", "--no-chat-template")
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    line, = r.stderr.splitlines()
    assert re.fullmatch(r"\[prefill \d+ tokens in \d+\.\d\ds · decode 4 tokens at \d+\.\d tok/s · "
                        r"bfloat16 weights, \d+\.\d\d GiB\]", line), line
    verbose = run_cli(*args, "--verbose")
    assert verbose.returncode == 0, verbose.stderr
    assert verbose.stderr.splitlines()[-1].startswith("[prefill ")
    assert any(log.startswith("nanoqwen: kernels: ") for log in verbose.stderr.splitlines()), verbose.stderr


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

    def stream(self, prompt, params, lora_request=None):
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


# ------------------------------------------------------------------ embed and rerank

TEXTS = ["The capital of France is Paris.", "", "  ", "Bananas are yellow.\r",
         "def f(x):\treturn x * 2", "日本語のテキスト", "Paris is in France."]
# The non-blank lines above, with their indexes (blank lines are skipped; "\r\n" endings removed)
KEPT = [(0, TEXTS[0]), (3, "Bananas are yellow."), (4, TEXTS[4]), (5, TEXTS[5]), (6, TEXTS[6])]
QUERY = "What is the capital of France?"


def json_lines(text: str) -> list[dict]:
    import json

    return [json.loads(line) for line in text.splitlines()]


@pytest.fixture(scope="module")
def embedding_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli-embed") / "embedding"
    r = run_cli("init-random", str(path), "--preset", "embedding-tiny", "--std", "0.05",
                "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    return path


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli-rerank") / "reranker"
    r = run_cli("init-random", str(path), "--preset", "reranker-tiny", "--std", "0.05",
                "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    return path


@pytest.fixture(scope="module")
def embedder(embedding_dir) -> LLM:
    return LLM(embedding_dir, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def reranker(reranker_dir) -> LLM:
    return LLM(reranker_dir, dtype="float32", device="cpu")


def assert_embeddings_equal(got: list[list[float]], expected: list[list[float]]) -> None:
    assert len(got) == len(expected)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=0, atol=1e-6)


def test_embed_cli_equals_llm_embed(embedding_dir, embedder):
    r = run_cli("embed", "--model", str(embedding_dir), "--dtype", "float32", "--device", "cpu",
                "--dimensions", "16", stdin="\n".join(TEXTS) + "\n")
    assert r.returncode == 0, r.stderr
    rows = json_lines(r.stdout)
    assert [row["index"] for row in rows] == [i for i, _ in KEPT]  # input order, blank lines skipped
    assert all(set(row) == {"index", "embedding"} for row in rows)
    expected = embedder.embed([t for _, t in KEPT], dimensions=16, use_tqdm=False)
    assert all(len(row["embedding"]) == 16 for row in rows)
    assert_embeddings_equal([row["embedding"] for row in rows],
                            [o.outputs.embedding for o in expected])
    norms = torch.tensor([row["embedding"] for row in rows]).norm(dim=1)
    torch.testing.assert_close(norms, torch.ones(len(rows)))
    # the summary line on stderr, nothing else
    assert re.fullmatch(r"\[embedded 5 inputs, \d+ tokens in .*\]\n", r.stderr), r.stderr


def test_embed_cli_prompt_name_input_file_and_all_dimensions(embedding_dir, embedder, tmp_path):
    path = tmp_path / "texts.txt"
    path.write_text("\n".join(TEXTS), encoding="utf-8")  # (no final newline)
    r = run_cli("embed", "--model", str(embedding_dir), "--dtype", "float32", "--input", str(path),
                "--prompt-name", "query", "--quiet")
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""  # --quiet: no summary line
    rows = json_lines(r.stdout)
    texts = [t for _, t in KEPT]
    expected = embedder.embed(texts, prompt_name="query", use_tqdm=False)
    assert all(len(row["embedding"]) == 64 for row in rows)  # the tiny model's hidden size
    assert_embeddings_equal([row["embedding"] for row in rows],
                            [o.outputs.embedding for o in expected])
    plain = embedder.embed(texts, use_tqdm=False)  # the prompt made a difference
    assert (torch.tensor([o.outputs.embedding for o in plain])
            - torch.tensor([row["embedding"] for row in rows])).abs().max() > 1e-3


def test_rerank_cli_equals_llm_score_sorted(reranker_dir, reranker):
    instruction = "Find the passage that answers the question"
    r = run_cli("rerank", "--model", str(reranker_dir), "--dtype", "float32", "--query", QUERY,
                "--instruction", instruction, stdin="\n".join(TEXTS) + "\n")
    assert r.returncode == 0, r.stderr
    rows = json_lines(r.stdout)
    docs = [t for _, t in KEPT]
    scores = [o.outputs.score for o in reranker.score(QUERY, docs, instruction=instruction,
                                                      use_tqdm=False)]
    expected = sorted(((s, i, d) for s, (i, d) in zip(scores, KEPT, strict=True)),
                      key=lambda x: (-x[0], x[1]))
    assert [row["index"] for row in rows] == [i for _, i, _ in expected]
    assert [row["document"] for row in rows] == [d for _, _, d in expected]
    torch.testing.assert_close(torch.tensor([row["score"] for row in rows]),
                               torch.tensor([s for s, _, _ in expected]), rtol=0, atol=1e-6)
    got = [row["score"] for row in rows]
    assert got == sorted(got, reverse=True) and all(0 <= s <= 1 for s in got)
    assert len(set(got)) > 1  # the documents were scored apart
    default = reranker.score(QUERY, docs, use_tqdm=False)  # the instruction made a difference
    assert max(abs(a - o.outputs.score) for a, o in zip(scores, default, strict=True)) > 1e-6


def test_rerank_cli_top_n(reranker_dir, tmp_path):
    path = tmp_path / "docs.txt"
    path.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    full = run_cli("rerank", "--model", str(reranker_dir), "--dtype", "float32", "--query", QUERY,
                   "--input", str(path), "-q")
    top = run_cli("rerank", "--model", str(reranker_dir), "--dtype", "float32", "--query", QUERY,
                  "--input", str(path), "--top-n", "2", "-q")
    assert full.returncode == 0 and top.returncode == 0, full.stderr + top.stderr
    assert len(json_lines(full.stdout)) == len(KEPT)
    assert json_lines(top.stdout) == json_lines(full.stdout)[:2]


def assert_one_line_error(r: SimpleNamespace, *fragments: str) -> None:
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert r.stdout == ""
    assert "Traceback" not in r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("nanoqwen: error: "), r.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_embed_with_a_generative_model_is_a_clear_error(model_dir):
    r = run_cli("embed", "--model", str(model_dir), stdin="hello\n")
    assert_one_line_error(r, "is a generative model", "not an embedding model", "--task embed")


def test_rerank_with_an_embedding_model_is_a_clear_error(embedding_dir):
    r = run_cli("rerank", "--model", str(embedding_dir), "--query", QUERY, stdin="hello\n")
    assert_one_line_error(r, "is an embedding model", "not a reranker", "nanoqwen embed")


@pytest.mark.parametrize("args, stdin, fragments", [
    ([], "\n  \n", ["no texts in stdin", "blank lines are skipped"]),
    (["--dimensions", "0"], "hello\n", ["--dimensions 0 must be at least 1"]),
    (["--dimensions", "65"], "hello\n", ["dimensions=65", "64"]),
    (["--prompt-name", "bogus"], "hello\n", ["'bogus'", "'query'"]),
    (["--max-model-len", "16"], "a\n" + "word " * 40 + "\n", ["input line 2", "max_model_len"]),
], ids=["no-input", "dimensions-0", "dimensions-too-many", "unknown-prompt", "line-too-long"])
def test_embed_bad_input_is_a_clear_error(embedding_dir, args, stdin, fragments):
    r = run_cli("embed", "--model", str(embedding_dir), "--dtype", "float32", *args, stdin=stdin)
    assert_one_line_error(r, *fragments)


def test_embed_and_rerank_truncate_long_lines_when_asked(embedding_dir, embedder, reranker_dir,
                                                         reranker):
    """--truncate-prompt-tokens K keeps a longer line's last K tokens (where the line above
    stops with an error)."""
    from nanoqwen.pooling_params import PoolingParams

    long_line = "word " * 40
    r = run_cli("embed", "--model", str(embedding_dir), "--dtype", "float32", "--max-model-len",
                "16", "--truncate-prompt-tokens", "12", "-q", stdin=f"a\n{long_line}\n")
    assert r.returncode == 0, r.stderr
    expected = embedder.embed(["a", long_line], PoolingParams(truncate_prompt_tokens=12),
                              use_tqdm=False)
    assert len(expected[1].prompt_token_ids) == 12
    assert_embeddings_equal([row["embedding"] for row in json_lines(r.stdout)],
                            [o.outputs.embedding for o in expected])
    r = run_cli("rerank", "--model", str(reranker_dir), "--dtype", "float32", "--query", "q",
                "--max-model-len", "64", "--truncate-prompt-tokens", "60", "-q",
                stdin=f"{long_line}\n")
    assert r.returncode == 0, r.stderr
    expected = reranker.score("q", [long_line], pooling_params=PoolingParams(
        truncate_prompt_tokens=60), use_tqdm=False)[0].outputs.score
    assert json_lines(r.stdout)[0]["score"] == pytest.approx(expected, abs=1e-6)


def test_embed_and_rerank_missing_model_or_input_file(tmp_path, reranker_dir):
    r = run_cli("embed", "--model", str(tmp_path / "nothing"), stdin="hello\n")
    assert_one_line_error(r, "does not exist")
    r = run_cli("rerank", "--model", str(reranker_dir), "--query", QUERY,
                "--input", str(tmp_path / "missing.txt"))
    assert_one_line_error(r, "cannot read --input", "missing.txt")
    r = run_cli("rerank", "--model", str(reranker_dir), "--query", QUERY, "--top-n", "0",
                stdin="doc\n")
    assert_one_line_error(r, "--top-n 0 must be at least 1")


def test_generate_with_speculative_config(model_dir, llm):
    """--speculative-config JSON: the same greedy text, and the speed line says how many tokens a
    step gave; a malformed value is one clear error."""
    config = '{"method": "self_quantized", "quantization": "int8", "num_speculative_tokens": 3}'
    r = run_cli("generate", "--model", str(model_dir), "--prompt", PROMPT, "--max-tokens", "16",
                "--temperature", "0", "--no-chat-template", "--dtype", "float32",
                "--speculative-config", config)
    assert r.returncode == 0, r.stderr
    params = SamplingParams(temperature=0, max_tokens=16)
    assert r.stdout == llm.generate(PROMPT, params, use_tqdm=False)[0].text + "\n"
    assert re.search(r"speculative: \d\.\d\d tokens per step, \d+% of drafts accepted", r.stderr)
    r = run_cli("generate", "--model", str(model_dir), "--prompt", PROMPT,
                "--speculative-config", '{"method": "ngram"}')
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "num_speculative_tokens" in r.stderr
