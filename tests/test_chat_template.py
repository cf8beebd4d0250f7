"""Chat templates render exactly as transformers' AutoTokenizer.apply_chat_template does."""

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import pytest
import tokenizers

from nanoqwen.errors import ConfigError, InvalidRequestError, NanoQwenError
from nanoqwen.tokenizer import Tokenizer

# transformers is imported lazily in a fixture, after this, so it never tries to reach the Hub.
os.environ["HF_HUB_OFFLINE"] = "1"

ASSETS = Path(__file__).resolve().parent.parent / "nanoqwen" / "assets" / "qwen3-0.6b"
QWEN3_TEMPLATE = json.loads((ASSETS / "tokenizer_config.json").read_text())["chat_template"]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city. Returns <b>温度</b> & 'conditions'.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. 北京"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    },
]
WEATHER_ARGS = {"city": "北京", "unit": "celsius"}
SEARCH_ARGS = {"query": "weather <today> & tomorrow"}


def tool_conversation(arguments_as_string: bool) -> list[dict[str, Any]]:
    def args(value: dict[str, str]) -> dict[str, str] | str:
        return json.dumps(value, ensure_ascii=False) if arguments_as_string else value

    calls = [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": args(WEATHER_ARGS)},
        },
        {
            "id": "call_2",
            "type": "function",
            "function": {"name": "search", "arguments": args(SEARCH_ARGS)},
        },
    ]
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What's the weather in Beijing? Also search for tomorrow."},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "晴 25°C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "Tomorrow: rain."},
    ]


MULTI_TURN = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nEarlier secret reasoning.\n</think>\n\nIt is 4."},
    {"role": "user", "content": "And 3+3?"},
]
CASES: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = {
    "single_turn": ([{"role": "user", "content": "Hello!"}], {}),
    "thinking_on": ([{"role": "user", "content": "Hello!"}], {"enable_thinking": True}),
    "thinking_off": ([{"role": "user", "content": "Hello!"}], {"enable_thinking": False}),
    "system": ([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}], {}),
    "multi_turn": (MULTI_TURN, {}),
    "multi_turn_thinking_off": (MULTI_TURN, {"enable_thinking": False}),
    "no_generation_prompt": (
        [*MULTI_TURN, {"role": "assistant", "content": "<think>\nLast reasoning.\n</think>\n\n6."}],
        {"add_generation_prompt": False},
    ),
    "reasoning_content_dropped": (
        [
            MULTI_TURN[0],
            {"role": "assistant", "content": "4", "reasoning_content": "Hidden."},
            MULTI_TURN[2],
        ],
        {},
    ),
    "reasoning_content_kept": (
        [MULTI_TURN[0], {"role": "assistant", "content": "4", "reasoning_content": "Shown."}],
        {"add_generation_prompt": False},
    ),
    "reasoning_alias": (
        [MULTI_TURN[0], {"role": "assistant", "content": "4", "reasoning": "Aliased."}],
        {"add_generation_prompt": False},
    ),
    "tools_dict_arguments": (tool_conversation(False), {"tools": TOOLS}),
    "tools_string_arguments": (tool_conversation(True), {"tools": TOOLS, "enable_thinking": False}),
    "tools_without_system": (tool_conversation(False)[1:], {"tools": TOOLS}),
}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_pretrained(ASSETS)


@pytest.fixture(scope="module")
def hf() -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(ASSETS))


def render_both(tok: Tokenizer, hf: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """Render with nanoqwen and transformers, assert text and ids agree, and return the text."""
    kwargs.setdefault("add_generation_prompt", True)  # the two libraries default differently
    text = tok.apply_chat_template(messages, **kwargs)
    ids = tok.apply_chat_template(messages, tokenize=True, **kwargs)
    assert text == hf.apply_chat_template(messages, tokenize=False, **kwargs)
    assert ids == hf.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)
    assert ids == tok.encode(text)
    return text


@pytest.mark.parametrize("case", CASES)
def test_matches_transformers(tok: Tokenizer, hf: Any, case: str) -> None:
    messages, kwargs = CASES[case]
    render_both(tok, hf, messages, **kwargs)


def test_exact_prompt_with_thinking_disabled(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "你好"}]
    text = tok.apply_chat_template(messages, enable_thinking=False)
    assert text == (
        "<|im_start|>user\n你好<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    ids = tok.apply_chat_template(messages, enable_thinking=False, tokenize=True)
    assert ids == [
        151644, 872, 198, 108386, 151645, 198, 151644, 77091, 198, 151667, 271, 151668, 271
    ]
    # thinking on by default
    assert tok.apply_chat_template(messages).endswith("<|im_start|>assistant\n")
    no_prompt = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert not no_prompt.endswith("assistant\n")


def test_earlier_thinking_is_dropped(tok: Tokenizer) -> None:
    text = tok.apply_chat_template(CASES["multi_turn"][0])
    assert "Earlier secret reasoning" not in text and "<think>" not in text
    assert "<|im_start|>assistant\nIt is 4.<|im_end|>" in text
    messages, kwargs = CASES["no_generation_prompt"]
    last = tok.apply_chat_template(messages, **kwargs)
    assert last.endswith(
        "<|im_start|>assistant\n<think>\nLast reasoning.\n</think>\n\n6.<|im_end|>\n"
    )
    assert "Hidden." not in tok.apply_chat_template(CASES["reasoning_content_dropped"][0])
    aliased = tok.apply_chat_template(CASES["reasoning_alias"][0], add_generation_prompt=False)
    assert aliased.endswith("<|im_start|>assistant\n<think>\nAliased.\n</think>\n\n4<|im_end|>\n")


def test_tools_render_like_training_data(tok: Tokenizer) -> None:
    text = tok.apply_chat_template(tool_conversation(False), tools=TOOLS)
    # Key order kept, no ASCII or HTML escaping: Jinja's own tojson would sort keys and write
    # \u003c.
    assert (
        '\n{"type": "function", "function": {"name": "get_weather", '
        '"description": "Current weather' in text
    )
    assert "<b>温度</b> & 'conditions'" in text and "\\u" not in text
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "北京", "unit": "celsius"}}'
        "\n</tool_call>"
        in text
    )
    # Both tool results share one user turn, and content=None did not render as "None".
    tool_turn = (
        "<|im_start|>user\n<tool_response>\n晴 25°C\n</tool_response>\n"
        "<tool_response>\nTomorrow: rain."
    )
    assert tool_turn in text
    assert text.count("<|im_start|>user") == 2 and "None" not in text


def test_tool_arguments_as_dict_or_string_render_the_same(tok: Tokenizer) -> None:
    as_dict = tok.apply_chat_template(tool_conversation(False), tools=TOOLS)
    assert as_dict == tok.apply_chat_template(tool_conversation(True), tools=TOOLS)


# ------------------------------------------------------------ template helpers


def with_template(tok: Tokenizer, template: str) -> Tokenizer:
    return Tokenizer(tok.backend, eos_token=tok.eos_token, pad_token=tok.pad_token,
                     chat_template=template)


def render_custom(tok: Tokenizer, hf: Any, template: str, messages: list[dict],
                  **kwargs: Any) -> str:
    text = with_template(tok, template).apply_chat_template(messages, add_generation_prompt=False,
                                                            **kwargs)
    assert text == hf.apply_chat_template(messages, chat_template=template, tokenize=False,
                                          **kwargs)
    return text


def test_tojson_matches_transformers(tok: Tokenizer, hf: Any) -> None:
    message = {"role": "user", "content": "<b>你好</b> & 'x'", "z": 1.5, "a": [1, None, True]}
    template = (
        "{{ messages[0] | tojson }}\n{{ messages[0] | tojson(indent=2) }}\n"
        "{{ messages[0] | tojson(separators=(',', ':'), sort_keys=true) }}\n"
        "{{ messages[0] | tojson(ensure_ascii=true) }}\n{{ messages[0] | tojson(2) }}"
    )
    lines = render_custom(tok, hf, template, [message]).split("\n")
    assert lines[0] == json.dumps(message, ensure_ascii=False)
    assert "\\u4f60" in lines[-2]
    # transformers' first positional argument is ensure_ascii, not indent as in Jinja's built-in
    # filter
    assert lines[-1] == json.dumps(message, ensure_ascii=True)


def test_template_variables(tok: Tokenizer, hf: Any) -> None:
    template = (
        "[{{ bos_token }}][{{ eos_token }}][{{ pad_token }}][{{ custom }}][{{ documents }}]"
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "({{ m.content }}){% endfor %}"
    )
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": None},
        {"role": "user"},
    ]
    text = render_custom(tok, hf, template, messages, custom="yes")
    # An undefined bos_token and a None content both print nothing, rather than "None".
    assert text == "[][<|im_end|>][<|endoftext|>][yes][None](a)()"


def test_block_whitespace_is_trimmed(tok: Tokenizer, hf: Any) -> None:
    template = (
        "{% for m in messages %}\n  {% if m.content %}\n{{ m.content }}\n  {% endif %}\n"
        "{% endfor %}\n"
    )
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    assert render_custom(tok, hf, template, messages) == "a\nb\n"


def test_strftime_now(tok: Tokenizer) -> None:
    before = datetime.now().strftime("%Y-%m-%d")
    text = with_template(tok, "{{ strftime_now('%Y-%m-%d') }}").apply_chat_template(
        [{"role": "user"}]
    )
    assert text in {before, datetime.now().strftime("%Y-%m-%d")}


# ------------------------------------------------------------ errors


def assert_no_jinja_leak(error: BaseException) -> None:
    assert isinstance(error, NanoQwenError) and not isinstance(error, jinja2.TemplateError)
    assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)


def test_raise_exception_in_template(tok: Tokenizer, hf: Any) -> None:
    # Some Qwen3 template revisions reject conversations without a user turn like this.
    guard = (
        "{%- if messages | selectattr('role', 'equalto', 'user') | list | length == 0 %}"
        "{{- raise_exception('No user query found in messages.') }}{%- endif %}"
    )
    messages = [{"role": "system", "content": "You are helpful."}]
    with pytest.raises(NanoQwenError, match="^No user query found in messages.$") as info:
        with_template(tok, guard + QWEN3_TEMPLATE).apply_chat_template(messages)
    assert_no_jinja_leak(info.value)
    with pytest.raises(jinja2.TemplateError, match="No user query found"):  # transformers agrees
        hf.apply_chat_template(messages, chat_template=guard + QWEN3_TEMPLATE, tokenize=False)


def test_empty_messages(tok: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError, match="empty") as info:
        tok.apply_chat_template([])
    assert_no_jinja_leak(info.value)


def test_template_runtime_error_is_wrapped(tok: Tokenizer) -> None:
    # The Qwen3 template adds the system content to a string; a list of content parts makes that
    # fail.
    with pytest.raises(InvalidRequestError, match="cannot format") as info:
        messages = [{"role": "system", "content": ["x"]}, {"role": "user", "content": "hi"}]
        tok.apply_chat_template(messages, tools=TOOLS)
    assert_no_jinja_leak(info.value)


def test_template_is_sandboxed(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidRequestError, match="unsafe") as info:
        with_template(tok, "{{ messages.append(1) }}").apply_chat_template(messages)
    assert_no_jinja_leak(info.value)
    assert messages == [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidRequestError, match="unsafe"):
        with_template(tok, "{{ ''.__class__.__mro__ }}").apply_chat_template(messages)


def test_invalid_messages(tok: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError):
        tok.apply_chat_template(["hello"])  # type: ignore[list-item]
    with pytest.raises(InvalidRequestError):
        tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                tools=["get_weather"])  # type: ignore[list-item]


def test_template_syntax_error(tok: Tokenizer) -> None:
    with pytest.raises(ConfigError, match="not valid Jinja"):
        with_template(tok, "{% if %}").apply_chat_template([{"role": "user", "content": "hi"}])


# ------------------------------------------------------------ template sources


def tiny_model(folder: Path, config: dict[str, Any] | None = None,
               jinja: str | None = None) -> Path:
    word_level = tokenizers.models.WordLevel({"<unk>": 0, "hi": 1}, unk_token="<unk>")
    backend = tokenizers.Tokenizer(word_level)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<|im_end|>"])
    backend.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (folder / "chat_template.jinja").write_text(jinja)
    return folder


HI = [{"role": "user", "content": "hi"}]


def test_no_chat_template(tmp_path: Path) -> None:
    tok = Tokenizer.from_pretrained(tiny_model(tmp_path, {"eos_token": "<|im_end|>"}))
    assert tok.encode("hi") == [1]  # the tokenizer itself still works
    with pytest.raises(ConfigError) as info:
        tok.apply_chat_template(HI)
    message = str(info.value)
    assert str(tmp_path) in message and "no chat template" in message and "raw prompt" in message


def test_chat_template_jinja_file_takes_precedence(tmp_path: Path) -> None:
    jinja = "from file: {{ messages[0].content }}"
    folder = tiny_model(tmp_path, {"chat_template": "from config"}, jinja=jinja)
    assert Tokenizer.from_pretrained(folder).apply_chat_template(HI) == "from file: hi"
    (folder / "tokenizer_config.json").unlink()
    assert Tokenizer.from_pretrained(folder).apply_chat_template(HI) == "from file: hi"


def test_named_chat_templates(tmp_path: Path) -> None:
    templates = [
        {"name": "tool_use", "template": "tools {{ tools | length }}"},
        {"name": "default", "template": "plain"},
    ]
    tok = Tokenizer.from_pretrained(tiny_model(tmp_path, {"chat_template": templates}))
    assert tok.apply_chat_template(HI) == "plain"
    assert tok.apply_chat_template(HI, tools=TOOLS) == "tools 2"


def test_named_chat_templates_without_default(tmp_path: Path) -> None:
    templates = [{"name": "rag", "template": "x"}]
    tok = Tokenizer.from_pretrained(tiny_model(tmp_path, {"chat_template": templates}))
    with pytest.raises(ConfigError, match="'default'"):
        tok.apply_chat_template(HI)
