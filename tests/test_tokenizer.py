"""Tokenizer encode/decode against known Qwen3 ids, and the streaming detokenizer."""

import json
from pathlib import Path

import numpy as np
import pytest
import tokenizers

from nanoqwen.errors import ConfigError, ModelNotFoundError
from nanoqwen.tokenizer import IncrementalDetokenizer, Tokenizer

ASSETS = Path(__file__).resolve().parent.parent / "nanoqwen" / "assets" / "qwen3-0.6b"

ENGLISH = ("The quick brown fox jumps over the lazy dog. It's 3.14159, isn't it?  Two  spaces, "
           "trailing  ")
CHINESE = "你好，世界！今天天气怎么样？我正在学习机器学习和自然语言处理。龘靐齉"
JAPANESE = "こんにちは世界。東京は日本の首都です。カタカナとひらがな、そして漢字。"
EMOJI = "Family 👨‍👩‍👧‍👦, flags 🇯🇵🇺🇸🏴‍☠️, skin tone 👍🏽, coder 🧑‍💻, heart ❤️, 🦩🪿"
CODE = "def f(x):\n\tif x:\n\t\treturn {'a': [1, 2]}\r\n    pass\n\n\n# 注释 ✓\n\tprint(f'{x!r}')\n"
SPECIAL = ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\n"
           "ok<|endoftext|>")
TEXTS = {"english": ENGLISH, "chinese": CHINESE, "japanese": JAPANESE, "emoji": EMOJI, "code": CODE}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_pretrained(ASSETS)


def byte_token_id(tok: Tokenizer, byte: int) -> int:
    """Id of the single-byte token for `byte`, via GPT-2's byte-to-unicode table that Qwen's BPE
    uses."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    unprintable = [b for b in range(256) if b not in printable]
    char = chr(byte) if byte in printable else chr(256 + unprintable.index(byte))
    token_id = tok.token_to_id(char)
    assert token_id is not None
    return token_id


def stream(tok: Tokenizer, ids: list[int],
           **kwargs: bool) -> tuple[IncrementalDetokenizer, list[str], str]:
    detok = IncrementalDetokenizer(tok, **kwargs)
    deltas = [detok.push(i) for i in ids]
    return detok, deltas, detok.flush()


# ------------------------------------------------------------ encode/decode


def test_known_ids_and_special_token_ids(tok: Tokenizer) -> None:
    assert tok.encode("<|im_start|>user\n你好<|im_end|>") == [151644, 872, 198, 108386, 151645]
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_id == 151645
    assert tok.pad_token_id == 151643
    assert tok.bos_token is None and tok.bos_token_id is None
    assert tok.vocab_size == 151669


def test_no_bos_is_added(tok: Tokenizer) -> None:
    assert tok.encode("hello", add_special_tokens=True) == tok.encode("hello") == [14990]


@pytest.mark.parametrize("name", [*TEXTS, "special"])
def test_round_trip(tok: Tokenizer, name: str) -> None:
    text = TEXTS.get(name, SPECIAL)
    ids = tok.encode(text)
    assert all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == text


def test_inline_special_tokens_are_single_ids(tok: Tokenizer) -> None:
    ids = tok.encode(SPECIAL)
    for token, token_id in [("<|im_start|>", 151644), ("<think>", 151667), ("</think>", 151668)]:
        assert tok.token_to_id(token) == token_id
        assert tok.id_to_token(token_id) == token
        assert token_id in ids
    assert ids.count(151645) == 1 and ids[-1] == 151643


def test_empty_and_unknown(tok: Tokenizer) -> None:
    assert tok.encode("") == []
    assert tok.decode([]) == ""
    assert tok.token_to_id("<|no such token|>") is None
    assert tok.id_to_token(10**9) is None


def test_decode_accepts_arrays(tok: Tokenizer) -> None:
    ids = tok.encode(CHINESE)
    assert tok.decode(np.array(ids)) == CHINESE
    assert tok.decode(tuple(ids)) == CHINESE


def test_skip_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode(SPECIAL)
    # <think> is an added token but not a special one, so it survives skipping, as in transformers
    assert tok.decode(ids, skip_special_tokens=True) == (
        "user\nhi\nassistant\n<think>\nhmm\n</think>\n\nok")
    assert tok.all_special_ids == list(range(151643, 151657))


def test_multibyte_characters_really_split_across_tokens(tok: Tokenizer) -> None:
    # Guards the streaming tests below: they are only meaningful if some tokens end mid-character.
    for text in (CHINESE, EMOJI):
        assert any("\ufffd" in tok.decode([i]) for i in tok.encode(text))


# ------------------------------------------------------------ streaming


@pytest.mark.parametrize("name", ["chinese", "japanese", "emoji", "code", "english"])
def test_stream_matches_decode(tok: Tokenizer, name: str) -> None:
    ids = tok.encode(TEXTS[name])
    detok, deltas, tail = stream(tok, ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) + tail == tok.decode(ids) == TEXTS[name]
    assert tail == ""
    assert detok.text == TEXTS[name]
    # text comes out as it goes, not all at the end
    assert sum(1 for d in deltas if d) > len(ids) // 3


def test_stream_emits_each_character_as_soon_as_it_is_complete(tok: Tokenizer) -> None:
    ids = tok.encode(EMOJI + CHINESE)
    detok = IncrementalDetokenizer(tok)
    for n, token_id in enumerate(ids, start=1):
        detok.push(token_id)
        so_far = tok.decode(ids[:n])
        if not so_far.endswith("\ufffd"):
            assert detok.text == so_far
        else:
            assert so_far.startswith(detok.text) and len(detok.text) < len(so_far)


def test_stream_decodes_a_small_window(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = tok.encode((CHINESE + EMOJI + CODE) * 5)
    assert len(ids) > 300
    window_sizes: list[int] = []
    real_decode = tok.decode

    def spy(token_ids: list[int], skip_special_tokens: bool = False) -> str:
        window_sizes.append(len(token_ids))
        return real_decode(token_ids, skip_special_tokens=skip_special_tokens)

    monkeypatch.setattr(tok, "decode", spy)
    _, deltas, tail = stream(tok, ids)
    monkeypatch.undo()
    assert "".join(deltas) + tail == tok.decode(ids)
    assert max(window_sizes) <= 8


def test_stream_with_incomplete_character_at_the_end(tok: Tokenizer) -> None:
    # "你" is E4 BD A0; stop after its first two bytes, so the text never becomes valid UTF-8.
    ids = tok.encode("hello ") + [byte_token_id(tok, 0xE4), byte_token_id(tok, 0xBD)]
    detok, deltas, tail = stream(tok, ids)
    assert tok.decode(ids).endswith("\ufffd")
    assert "".join(deltas) == "hello "
    assert tail == tok.decode(ids)[len("hello ") :]
    assert "".join(deltas) + tail == detok.text == tok.decode(ids)
    assert detok.flush() == ""  # flushing twice emits nothing more


def test_stream_lone_byte_token(tok: Tokenizer) -> None:
    ids = [byte_token_id(tok, 0xE4)]
    _, deltas, tail = stream(tok, ids)
    assert deltas == [""]
    assert tail == tok.decode(ids) == "\ufffd"


def test_stream_completes_a_character_split_into_single_bytes(tok: Tokenizer) -> None:
    ids = [byte_token_id(tok, b) for b in "你".encode()] + tok.encode("!")
    _, deltas, tail = stream(tok, ids)
    assert deltas == ["", "", "你", "!"]
    assert tail == ""


def test_stream_with_invalid_bytes_in_the_middle(tok: Tokenizer) -> None:
    lead, invalid = byte_token_id(tok, 0xE4), byte_token_id(tok, 0xFF)
    ids = [lead, *tok.encode(" world 你好"), invalid, *tok.encode("x")]
    _, deltas, tail = stream(tok, ids)
    assert "".join(deltas) + tail == tok.decode(ids) == "\ufffd world 你好\ufffdx"


def test_stream_skip_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode(SPECIAL + "你好👍🏽")
    detok, deltas, tail = stream(tok, ids, skip_special_tokens=True)
    assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=True)
    assert "<|im_end|>" not in detok.text and "<think>" in detok.text


# ------------------------------------------------------------ loading errors


def write_tiny_tokenizer(folder: Path) -> None:
    word_level = tokenizers.models.WordLevel({"<unk>": 0, "hi": 1}, unk_token="<unk>")
    backend = tokenizers.Tokenizer(word_level)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<|endoftext|>", "<|im_end|>"])
    backend.save(str(folder / "tokenizer.json"))


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "nope")


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        Tokenizer.from_pretrained(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(info.value)
    assert "not found" in str(info.value)


def test_corrupt_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(ConfigError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_corrupt_tokenizer_config(tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(ConfigError) as info:
        Tokenizer.from_pretrained(tmp_path)
    assert str(tmp_path / "tokenizer_config.json") in str(info.value)


def test_special_tokens_as_dicts_or_missing(tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path)
    tok = Tokenizer.from_pretrained(tmp_path)  # tokenizer_config.json is optional
    assert tok.eos_token_id is None and tok.pad_token_id is None
    eos = {"content": "<|im_end|>", "lstrip": False, "rstrip": False, "special": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos,
                                                                "pad_token": None}))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 3
    assert tok.encode("hi <|im_end|>") == [1, 3]


def test_eos_token_outside_vocabulary(tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    with pytest.raises(ConfigError, match="</s>"):
        Tokenizer.from_pretrained(tmp_path)
