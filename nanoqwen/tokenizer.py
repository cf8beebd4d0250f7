"""Qwen3 tokenizer, chat templates and streaming detokenisation.

Encoding goes through Hugging Face `tokenizers` and templates render as in transformers, so prompts
match the reference token for token: the model was trained on exactly those bytes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from nanoqwen.errors import ConfigError, InvalidRequestError, ModelNotFoundError, NanoQwenError

_REPLACEMENT_CHAR = "\ufffd"
# Older names for a message's reasoning. transformers copies them into `reasoning_content`
# (what Qwen3's template reads) and into `thinking`; we do the same so a request renders
# identically either way.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message: str) -> None:
    # Templates call this to reject conversations they cannot express, so it is
    # the request that is wrong.
    raise InvalidRequestError(str(message))


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's built-in tojson sorts keys and HTML-escapes <>&'. transformers swaps in plain
    # json.dumps that keeps key order and non-ASCII text, and Qwen3 was trained on tool
    # schemas rendered that way.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


# Chat templates ship inside downloaded model folders, i.e. they are untrusted
# code: render them sandboxed.
_JINJA_ENV = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
)
_JINJA_ENV.filters["tojson"] = _tojson
_JINJA_ENV.globals["raise_exception"] = _raise_exception
_JINJA_ENV.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not a readable JSON file ({e}); re-download it") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path} should contain a JSON object, found {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens either as plain strings or as
    # serialized AddedToken dicts.
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _normalize_message(message: Mapping[str, Any]) -> dict[str, Any]:
    # As transformers does: drop None values (OpenAI clients send content=None next to tool_calls,
    # which a template would print as "None") and alias the reasoning field names.
    msg = {key: value for key, value in message.items() if value is not None}
    reasoning = next((msg[key] for key in _REASONING_FIELDS if key in msg), None)
    if reasoning is not None:
        msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
    return msg


class Tokenizer:
    """A Qwen3 tokenizer: byte-level BPE from `tokenizers` plus the model's Jinja chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | Mapping[str, str] | None = None,
        origin: str = "this tokenizer",
    ) -> None:
        self.backend = backend
        self.origin = origin  # named in error messages so users know which file to fix
        self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
        self.bos_token_id = self._special_id("bos_token", bos_token)
        self.eos_token_id = self._special_id("eos_token", eos_token)
        self.pad_token_id = self._special_id("pad_token", pad_token)
        if isinstance(chat_template, str):
            chat_template = {"default": chat_template}
        self.chat_templates: dict[str, str] = dict(chat_template or {})
        self._compiled: dict[str, jinja2.Template] = {}

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and chat_template.jinja (if any) from a
        model folder."""
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise ModelNotFoundError(f"model folder {model_dir} does not exist")
        tokenizer_path = model_dir / "tokenizer.json"
        if not tokenizer_path.is_file():
            raise ConfigError(
                f"{tokenizer_path} not found: nanoqwen needs the Hugging Face fast-tokenizer file "
                "tokenizer.json that Qwen3 model repos ship next to config.json"
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_path))
        except Exception as e:  # the Rust loader raises a bare Exception for malformed files
            raise ConfigError(f"{tokenizer_path} could not be loaded as a tokenizers JSON file "
                              f"({e})") from e

        config_path = model_dir / "tokenizer_config.json"
        config = _read_json(config_path) if config_path.is_file() else {}
        template, origin = config.get("chat_template"), config_path
        jinja_path = model_dir / "chat_template.jinja"
        # newer repos keep the template in its own file, and it takes precedence
        if jinja_path.is_file():
            template, origin = jinja_path.read_text(encoding="utf-8"), jinja_path
        # named templates: [{"name": "default", "template": "..."}, ...]
        if isinstance(template, list):
            try:
                template = {entry["name"]: entry["template"] for entry in template}
            except (TypeError, KeyError):
                raise ConfigError(f"{origin}: chat_template entries need 'name' and "
                                  "'template'") from None
        if template is not None and not isinstance(template, str | dict):
            raise ConfigError(f"{origin}: chat_template should be a string, "
                              f"found {type(template).__name__}")
        return cls(
            backend,
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            pad_token=_token_content(config.get("pad_token")),
            chat_template=template,
            origin=str(origin if template is not None or config else model_dir),
        )

    def _special_id(self, name: str, token: str | None) -> int | None:
        token_id = None if token is None else self.backend.token_to_id(token)
        if token is not None and token_id is None:
            raise ConfigError(f"{self.origin}: {name} {token!r} is not in the tokenizer's "
                              "vocabulary")
        return token_id

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce, added tokens included (151669 for
        Qwen3)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of the special added tokens, i.e. those `decode(skip_special_tokens=True)` drops."""
        added = self.backend.get_added_tokens_decoder()
        return sorted(i for i, tok in added.items() if tok.special)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written inline (e.g. "<|im_end|>") become their
        single id."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; bytes that are not valid UTF-8 (e.g. a cut-off character) become
        U+FFFD."""
        # accept tensors and numpy arrays
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def _template_for(self, tools: list[dict] | None) -> jinja2.Template:
        # Same choice as transformers among named templates: "tool_use" when tools are given,
        # else "default".
        if not self.chat_templates:
            raise ConfigError(
                f"{self.origin} has no chat template (no 'chat_template' in "
                "tokenizer_config.json and no chat_template.jinja), so chat messages cannot be "
                "formatted; pass a raw prompt string instead"
            )
        name = "tool_use" if tools is not None and "tool_use" in self.chat_templates else "default"
        if name not in self.chat_templates:
            found = sorted(self.chat_templates)
            raise ConfigError(f"{self.origin} has no 'default' chat template (found: {found})")
        if name not in self._compiled:
            try:
                self._compiled[name] = _JINJA_ENV.from_string(self.chat_templates[name])
            except jinja2.TemplateSyntaxError as e:
                where = f"the chat template in {self.origin}"
                raise ConfigError(f"{where} is not valid Jinja "
                                  f"(line {e.lineno}: {e.message})") from None
        return self._compiled[name]

    def apply_chat_template(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Format a conversation as the model's prompt text (or its token ids if `tokenize`).

        `messages` are OpenAI-style dicts; assistant `tool_calls` arguments may be a dict or a JSON
        string. Extra keyword arguments are passed to the template as variables.
        """
        template = self._template_for(tools)
        if not isinstance(messages, list | tuple) or not all(isinstance(m, Mapping)
                                                             for m in messages):
            raise InvalidRequestError("messages must be a list of "
                                      "{'role': ..., 'content': ...} dicts")
        if not messages:
            raise InvalidRequestError("messages is empty: "
                                      "pass at least one {'role': 'user', ...} message")
        if tools is not None and not all(isinstance(t, Mapping) for t in tools):
            raise InvalidRequestError("tools must be a list of JSON-schema dicts")
        specials = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                    "pad_token": self.pad_token}
        variables = {
            "documents": None,
            # A None special token must stay undefined: Jinja would print it as the text "None".
            **{name: token for name, token in specials.items() if token is not None},
            **kwargs,
            "messages": [_normalize_message(m) for m in messages],
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
            "enable_thinking": enable_thinking,
        }
        try:
            text = template.render(variables)
        except NanoQwenError:
            raise  # raise_exception() from the template: its message is meant for the user
        except (jinja2.TemplateError, TypeError, ValueError) as e:
            # Hide the Jinja type: callers should only have to catch nanoqwen errors.
            where = f"the chat template in {self.origin}"
            raise InvalidRequestError(f"{where} cannot format these messages: {e}") from None
        return self.encode(text, add_special_tokens=False) if tokenize else text


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never split a UTF-8 character.

    Byte-level BPE may end a token in the middle of a character (Chinese, emoji), and decoding
    such a prefix ends in U+FFFD. Like vLLM and TGI we keep two offsets into the ids: text up to
    `read_offset` has been emitted, and each step decodes only from `prefix_offset` (the start of
    the previous delta), so the cost per token stays constant. The prefix is decoded too, rather
    than just the new ids, because decoders may render a token differently at the start of a
    string than after context.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        # all text emitted so far; held-back partial characters join it once complete
        self.text = ""

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became final, possibly ""."""
        self.ids.append(int(token_id))
        prefix, window = self._decode_window()
        if len(window) <= len(prefix) or window.endswith(_REPLACEMENT_CHAR):
            return ""  # nothing new yet, or the last character is still missing bytes
        return self._emit(window[len(prefix) :])

    def flush(self) -> str:
        """Return whatever is held back (incomplete bytes decode to U+FFFD, as `decode` gives
        them)."""
        prefix, window = self._decode_window()
        return self._emit(window[len(prefix) :])

    def _decode_window(self) -> tuple[str, str]:
        decode, skip = self.tokenizer.decode, self.skip_special_tokens
        prefix = decode(self.ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip)
        window = decode(self.ids[self._prefix_offset :], skip_special_tokens=skip)
        return prefix, window

    def _emit(self, delta: str) -> str:
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        self.text += delta
        return delta
