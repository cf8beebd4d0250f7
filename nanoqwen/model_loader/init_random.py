"""Write complete Qwen3 model folders with random weights, so everything runs offline.

The folder has what a hub checkpoint has: config.json and generation_config.json, the
official Qwen3 tokenizer files (shipped in nanoqwen/assets), and the weights under the
official tensor names in model.safetensors, or in shards with model.safetensors.index.json.
MoE experts are written one tensor per expert matrix, as the official Qwen3-MoE checkpoints
(and transformers' save_pretrained) store them, or, on request, stacked as
transformers 5 holds them.

The embedding and reranker presets are laid out as Qwen3-Embedding and Qwen3-Reranker are
published (their files are not byte copies: they are written here from the published layout, see
`_write_task_files`): an embedding model's weights are saved from the bare decoder (no "model."
prefix, no LM head) beside sentence-transformers' files, and its tokenizer appends an end-of-text
token; a reranker is a causal LM whose model card says `pipeline_tag: text-ranking`.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file

from nanoqwen.config.model import Qwen3Config, read_json
from nanoqwen.errors import ConfigError
from nanoqwen.model_loader.weight_files import write_index

ASSETS = Path(str(resources.files("nanoqwen") / "assets"))
QWEN3_0_6B = ASSETS / "qwen3-0.6b"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _official(name: str) -> dict:
    path = (QWEN3_0_6B / "config.json" if name == "Qwen3-0.6B"
            else ASSETS / "configs" / f"{name}.json")
    return read_json(path)


def _tiny() -> dict:
    """A 2-layer model with the real vocabulary: seconds to load, every code path of the big
    ones."""
    return {**_official("Qwen3-0.6B"), "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32}


def _moe_tiny() -> dict:
    """Qwen3-30B-A3B's config at toy size: 8 experts, top-2, 3 layers of which layer 1 is a
    dense MLP."""
    return {**_official("Qwen3-30B-A3B"), "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "mlp_only_layers": [1], "max_window_layers": 3}


def _pooling(base: dict) -> dict:
    """Qwen3-Embedding / Qwen3-Reranker: the Qwen3 decoder with the vocabulary cut to the tokenizer's
    151669 tokens (the generative models pad it to 151936) and a 32K context."""
    return {**base, "vocab_size": 151669, "max_position_embeddings": 32768}


PRESETS = {
    "tiny": _tiny,
    "embedding-tiny": lambda: _pooling(_tiny()),
    "reranker-tiny": lambda: _pooling(_tiny()),
    "qwen3-embedding-0.6b": lambda: _pooling(_official("Qwen3-0.6B")),
    "qwen3-reranker-0.6b": lambda: _pooling(_official("Qwen3-0.6B")),
    "qwen3-moe-tiny": _moe_tiny,
    "qwen3-0.6b": lambda: _official("Qwen3-0.6B"),
    "qwen3-1.7b": lambda: _official("Qwen3-1.7B"),
    "qwen3-4b": lambda: _official("Qwen3-4B"),
    "qwen3-8b": lambda: _official("Qwen3-8B"),
    "qwen3-14b": lambda: _official("Qwen3-14B"),
    "qwen3-32b": lambda: _official("Qwen3-32B"),
    "qwen3-30b-a3b": lambda: _official("Qwen3-30B-A3B"),
}


# what each preset's folder is for (nanoqwen/config/pooling.py reads it back from the files)
PRESET_TASKS = {"embedding-tiny": "embed", "qwen3-embedding-0.6b": "embed",
                "reranker-tiny": "score", "qwen3-reranker-0.6b": "score"}


def preset_config(preset: str) -> dict:
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[preset]()


def checkpoint_shapes(config: Qwen3Config, fused_experts: bool = False,
                      bare: bool = False) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(official tensor name, shape) of every tensor a Qwen3 checkpoint with this config holds.

    fused_experts: MoE experts under transformers 5's stacked names instead of one tensor per
    expert matrix. bare: the bare decoder's tensors (transformers' Qwen3Model, as Qwen3-Embedding
    is saved): no "model." prefix, no LM head.
    """
    if bare:
        for name, shape in checkpoint_shapes(config, fused_experts):
            if name != "lm_head.weight":
                yield name.removeprefix("model."), shape
        return
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    inter = config.intermediate_size
    yield "model.embed_tokens.weight", (config.vocab_size, h)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,)
        yield p + "self_attn.q_proj.weight", (q, h)
        yield p + "self_attn.k_proj.weight", (kv, h)
        yield p + "self_attn.v_proj.weight", (kv, h)
        if config.attention_bias:
            yield from ((p + f"self_attn.{n}_proj.bias", (s,))
                        for n, s in (("q", q), ("k", kv), ("v", kv)))
        yield p + "self_attn.o_proj.weight", (h, q)
        if config.attention_bias:
            yield p + "self_attn.o_proj.bias", (h,)
        yield p + "self_attn.q_norm.weight", (d,)
        yield p + "self_attn.k_norm.weight", (d,)
        yield p + "post_attention_layernorm.weight", (h,)
        if config.is_moe_layer(i):
            yield from _expert_shapes(config, p + "mlp.", fused_experts)
            continue
        yield p + "mlp.gate_proj.weight", (inter, h)
        yield p + "mlp.up_proj.weight", (inter, h)
        yield p + "mlp.down_proj.weight", (h, inter)
    yield "model.norm.weight", (h,)
    if not config.tie_word_embeddings:
        yield "lm_head.weight", (config.vocab_size, h)


def _expert_shapes(config: Qwen3Config, p: str,
                   fused: bool) -> Iterator[tuple[str, tuple[int, ...]]]:
    e, h, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
    yield p + "gate.weight", (e, h)  # the router
    if fused:
        yield p + "experts.gate_up_proj", (e, 2 * inter, h)
        yield p + "experts.down_proj", (e, h, inter)
        return
    for j in range(e):
        yield p + f"experts.{j}.gate_proj.weight", (inter, h)
        yield p + f"experts.{j}.up_proj.weight", (inter, h)
        yield p + f"experts.{j}.down_proj.weight", (h, inter)


def random_tensor(name: str, shape: tuple[int, ...], std: float,
                  generator: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):  # norms near 1, but not exactly, so a mis-loaded norm shows
        return 1.0 + 0.1 * torch.randn(shape, generator=generator)
    return std * torch.randn(shape, generator=generator)


def write_random_model(out_dir: str | Path, config: dict | str = "tiny", dtype: str = "bfloat16",
                       std: float = 0.02, seed: int = 0, max_shard_bytes: int = 2 << 30,
                       fused_experts: bool = False, task: str | None = None) -> Path:
    """Write a model folder with config (a preset name or a config.json dict) and N(0, std) weights.

    fused_experts: write MoE experts stacked, as transformers 5 names them (see checkpoint_shapes).
    task: "embed" or "score" lays the folder out as Qwen3-Embedding or Qwen3-Reranker is published
    (default: the preset's, else a generative model).
    """
    if task is None and isinstance(config, str):
        task = PRESET_TASKS.get(config)
    raw = preset_config(config) if isinstance(config, str) else dict(config)
    raw["torch_dtype"] = dtype
    cfg = Qwen3Config.from_dict(raw, where="config")  # validates before anything is written
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    for name in TOKENIZER_FILES + ("generation_config.json",):
        shutil.copyfile(QWEN3_0_6B / name, out / name)
    if task in ("embed", "score"):
        _write_task_files(out, task)
    generator = torch.Generator().manual_seed(seed)
    torch_dtype = getattr(torch, dtype)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for name, shape in checkpoint_shapes(cfg, fused_experts, bare=task == "embed"):
        t = random_tensor(name, shape, std, generator).to(torch_dtype)
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            _flush(out, shards, final=False)
            shards.append({})
            size = 0
        shards[-1][name] = t
        size, total = size + nbytes, total + nbytes
    _flush(out, shards, final=True, total_size=total)
    return out


# The sentence-transformers files of Qwen3-Embedding, written from their published layout: a
# Transformer module, last-token pooling, normalisation, and the model card's query prompt.
EMBEDDING_QUERY_PROMPT = ("Instruct: Given a web search query, retrieve relevant passages that "
                          "answer the query\nQuery:")
SENTENCE_TRANSFORMERS_FILES = {
    "modules.json": [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize",
         "type": "sentence_transformers.models.Normalize"}],
    "config_sentence_transformers.json": {
        "prompts": {"query": EMBEDDING_QUERY_PROMPT, "document": ""},
        "default_prompt_name": None, "similarity_fn_name": "cosine"},
    "sentence_bert_config.json": {"max_seq_length": 8192, "do_lower_case": False},
    "1_Pooling/config.json": {
        "word_embedding_dimension": None, "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": True, "include_prompt": True},
}
MODEL_CARDS = {"embed": "---\nlicense: apache-2.0\npipeline_tag: feature-extraction\n"
                        "library_name: sentence-transformers\n---\n\n# Qwen3-Embedding (random weights)\n",
               "score": "---\nlicense: apache-2.0\npipeline_tag: text-ranking\n---\n\n"
                        "# Qwen3-Reranker (random weights)\n"}


def _write_task_files(out: Path, task: str) -> None:
    """An embedding model's sentence-transformers files and end-of-text-appending tokenizer, or a
    reranker's model card."""
    (out / "README.md").write_text(MODEL_CARDS[task])
    if task != "embed":
        return
    config = read_json(out / "config.json")
    for name, content in SENTENCE_TRANSFORMERS_FILES.items():
        if name == "1_Pooling/config.json":
            content = {**content, "word_embedding_dimension": config["hidden_size"]}
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(json.dumps(content, indent=2) + "\n")
    # The published embedding tokenizer's post-processor appends <|endoftext|> to every input (the
    # token whose hidden state is the embedding); inputs are padded on the left.
    tokenizer = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))
    eos = "<|endoftext|>"
    eos_id = next(t["id"] for t in tokenizer["added_tokens"] if t["content"] == eos)
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": eos, "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": eos, "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}, {"SpecialToken": {"id": eos, "type_id": 1}}],
        "special_tokens": {eos: {"id": eos, "ids": [eos_id], "tokens": [eos]}}}
    (out / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    tokenizer_config = read_json(out / "tokenizer_config.json")
    tokenizer_config["padding_side"] = "left"
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2,
                                                          ensure_ascii=False))


def _flush(out: Path, shards: list[dict[str, torch.Tensor]], final: bool,
           total_size: int = 0) -> None:
    """Write the last shard (freeing its tensors); on the final call, name the files and write
    the index."""
    n = len(shards)
    save_file(shards[-1], out / f"shard-{n}.tmp", metadata={"format": "pt"})
    shards[-1] = {k: None for k in shards[-1]}  # keep the names, drop the tensors
    if not final:
        return
    for stale in list(out.glob("model*.safetensors")) + [out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    if n == 1:
        (out / "shard-1.tmp").rename(out / "model.safetensors")
        return
    names = {}
    for i in range(1, n + 1):
        file = f"model-{i:05d}-of-{n:05d}.safetensors"
        (out / f"shard-{i}.tmp").rename(out / file)
        names[file] = list(shards[i - 1])
    write_index(out, names, total_size)
