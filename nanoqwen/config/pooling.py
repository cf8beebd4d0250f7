"""Which task a checkpoint is for (generate, embed, score), and sentence-transformers' settings beside an
embedding model.

Embedding and reranking use the same decoder, read differently at the last token (the poolers:
nanoqwen/layers/pooler.py; their prompts: nanoqwen/engine/input_processor.py).

Qwen3-Embedding: the final hidden state (after the final norm) of an input's last token, which its
tokenizer makes an end-of-text token, L2-normalised; the first d values renormalised give a
d-dimensional embedding (the models are trained for that, Matryoshka style).

Qwen3-Reranker: a query and a document are written into the model card's yes/no prompt, and the
relevance is the probability of "yes" against "no" for the next token: softmax over just those two
rows of the LM head, never the whole vocabulary.

Which of the three tasks a checkpoint is for (generate, embed, score) is read from its files, as
vLLM and sentence-transformers do: sentence-transformers' files beside an embedding model, or the
model card's `pipeline_tag`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from nanoqwen.config.model import BARE_ARCHITECTURE, read_json
from nanoqwen.errors import ConfigError, InvalidRequestError

TASKS = ("generate", "embed", "score")
# the model card's pipeline_tag (README.md front matter) -> task
PIPELINE_TAGS = {"feature-extraction": "embed", "sentence-similarity": "embed",
                 "text-ranking": "score", "text-generation": "generate"}


def detect_task(model_dir: Path) -> str:
    """The task a checkpoint folder is published for: "embed" with sentence-transformers' files or
    a bare decoder's config (architectures ["Qwen3Model"]), else its model card's pipeline_tag,
    else "generate"."""
    if (model_dir / "modules.json").is_file() or (model_dir / "config_sentence_transformers.json"
                                                  ).is_file():
        return "embed"
    if (model_dir / "config.json").is_file():
        architectures = read_json(model_dir / "config.json").get("architectures") or [None]
        if architectures[0] == BARE_ARCHITECTURE:
            return "embed"
    readme = model_dir / "README.md"
    if readme.is_file():
        text = readme.read_text(encoding="utf-8", errors="replace")
        front = re.match(r"---\n(.*?)\n---", text, re.DOTALL)
        tag = re.search(r"^pipeline_tag:\s*([\w-]+)", front[1], re.MULTILINE) if front else None
        if tag and tag[1] in PIPELINE_TAGS:
            return PIPELINE_TAGS[tag[1]]
    return "generate"


def resolve_task(model_dir: Path, task: str | None) -> str:
    if task in (None, "auto"):
        return detect_task(model_dir)
    if task not in TASKS:
        raise ConfigError(f"task={task!r} is not a task; choose one of auto, {', '.join(TASKS)}")
    return task


@dataclass
class SentenceTransformersConfig:
    """What sentence-transformers' files beside an embedding model say: its named prompts
    (config_sentence_transformers.json), its max_seq_length (sentence_bert_config.json) and its
    pooling (modules.json, 1_Pooling/config.json)."""

    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    max_seq_length: int | None = None
    normalize: bool = True

    @classmethod
    def from_dir(cls, model_dir: Path) -> SentenceTransformersConfig:
        """The folder's settings; the Qwen3-Embedding defaults (no prompts, last-token pooling,
        normalised) where its files are absent."""
        st = cls()
        if (path := model_dir / "config_sentence_transformers.json").is_file():
            raw = read_json(path)
            prompts = raw.get("prompts") or {}
            if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
                raise ConfigError(f"{path}: 'prompts' must map prompt names to strings")
            st.prompts, st.default_prompt_name = dict(prompts), raw.get("default_prompt_name")
        if (path := model_dir / "sentence_bert_config.json").is_file():
            st.max_seq_length = read_json(path).get("max_seq_length")
        if (path := model_dir / "modules.json").is_file():
            modules = _read_list(path)
            types = [m.get("type", "") for m in modules]
            st.normalize = any(t.endswith("Normalize") for t in types)
            for m in modules:
                if m.get("type", "").endswith("Pooling"):
                    pooling = read_json(model_dir / m.get("path", "") / "config.json")
                    if not pooling.get("pooling_mode_lasttoken"):
                        modes = [k for k, v in pooling.items() if k.startswith("pooling_mode") and v]
                        raise ConfigError(f"{model_dir / m.get('path', '')}/config.json pools with "
                                          f"{modes}: nanoqwen pools the last token only "
                                          "(pooling_mode_lasttoken, as Qwen3-Embedding does)")
        return st

    def prompt(self, prompt_name: str | None, prompt: str | None) -> str:
        """The text put before each input: `prompt` as given, else the named one, else the
        default one (sentence-transformers' encode rules)."""
        if prompt is not None:
            return prompt
        name = prompt_name if prompt_name is not None else self.default_prompt_name
        if name is None:
            return ""
        if name not in self.prompts:
            known = ", ".join(repr(p) for p in self.prompts) or "none"
            raise InvalidRequestError(f"prompt_name {name!r} is not one of this model's prompts "
                                      f"(config_sentence_transformers.json has: {known})")
        return self.prompts[name]


def _read_list(path: Path) -> list[dict]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(data, list) or not all(isinstance(m, dict) for m in data):
        raise ConfigError(f"{path} must hold a JSON list of modules")
    return data
