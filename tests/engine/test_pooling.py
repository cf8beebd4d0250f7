"""Embedding (Qwen3-Embedding) and reranking (Qwen3-Reranker) models through the same engine, against
transformers, sentence-transformers and the model cards' recipes on random-weight checkpoints laid
out as the published ones are."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import make_llm
from safetensors.torch import load_file, save_file

from nanoqwen import LLM
from nanoqwen.config.pooling import detect_task
from nanoqwen.engine.input_processor import RERANK_PREFIX, RERANK_SUFFIX
from nanoqwen.errors import ConfigError, InvalidRequestError
from nanoqwen.model_loader.init_random import EMBEDDING_QUERY_PROMPT, preset_config, write_random_model
from nanoqwen.pooling_params import PoolingParams
from nanoqwen.sampling_params import SamplingParams

TEXTS = ["The capital of France is Paris.", "hello", "Gravity pulls every mass toward every other "
         "mass, and the force falls with the square of the distance between them.", "日本語のテキスト",
         "a b c d e f g h i j k l m n o p q r s t u v w x y z " * 3]
QUERY = "What is the capital of China?"
DOCUMENTS = ["The capital of China is Beijing.", "Gravity is a force.", "Paris", "x " * 40]


@pytest.fixture(scope="module")
def embedding_dir(tmp_path_factory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("emb"), "embedding-tiny", dtype="float32",
                              std=0.05)


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("rr"), "reranker-tiny", dtype="float32",
                              std=0.1)


@pytest.fixture(scope="module")
def embedder(embedding_dir) -> LLM:
    return make_llm(embedding_dir, max_model_len=256, kv_cache_memory=16 << 20)


@pytest.fixture(scope="module")
def reranker(reranker_dir) -> LLM:
    return make_llm(reranker_dir, max_model_len=256, kv_cache_memory=16 << 20)


def embeddings(outputs) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outputs])


def transformers_embeddings(model_dir: Path, texts: list[str], prompt: str = "") -> torch.Tensor:
    """The Qwen3-Embedding model card's recipe: left-padded batch through transformers' Qwen3Model,
    the last token's hidden state, L2-normalised."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    batch = tokenizer([prompt + t for t in texts], padding=True, truncation=True, max_length=8192,
                      return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state  # [B, T, H]
    return F.normalize(hidden[:, -1], p=2, dim=1)


def model_card_scores(model_dir: Path, query: str, documents: list[str],
                      instruction: str | None = None) -> torch.Tensor:
    """The Qwen3-Reranker model card's recipe through transformers' Qwen3ForCausalLM."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    instruction = instruction or ("Given a web search query, retrieve relevant passages that "
                                  "answer the query")
    pairs = [f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {d}" for d in documents]
    prefix = tokenizer.encode(RERANK_PREFIX, add_special_tokens=False)
    suffix = tokenizer.encode(RERANK_SUFFIX, add_special_tokens=False)
    inputs = tokenizer(pairs, padding=False, truncation="longest_first",
                       return_attention_mask=False, max_length=8192 - len(prefix) - len(suffix))
    inputs["input_ids"] = [prefix + ids + suffix for ids in inputs["input_ids"]]
    inputs = tokenizer.pad(inputs, padding=True, return_tensors="pt")
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    with torch.no_grad():
        logits = model(**inputs).logits[:, -1, :]
    two = torch.stack([logits[:, no], logits[:, yes]], dim=1)
    return torch.log_softmax(two, dim=1)[:, 1].exp()


# ---- which task a checkpoint is for ----

def test_task_is_read_from_the_checkpoint_files(embedding_dir, reranker_dir, tiny_dir, embedder,
                                                reranker):
    assert detect_task(embedding_dir) == "embed"  # sentence-transformers' files
    assert detect_task(reranker_dir) == "score"  # the model card's pipeline_tag: text-ranking
    assert detect_task(tiny_dir) == "generate"
    assert embedder.llm_engine.task == "embed" and reranker.llm_engine.task == "score"
    # an embedding model has no LM head; a reranker keeps two of its rows, not the vocabulary
    assert embedder.llm_engine.model.lm_head is None


def test_task_can_be_forced_and_is_checked(embedding_dir, tmp_path):
    llm = make_llm(embedding_dir, task="generate")
    assert llm.llm_engine.task == "generate"
    with pytest.raises(ConfigError, match="task='rank' is not a task"):
        make_llm(embedding_dir, task="rank")
    card = tmp_path / "README.md"
    card.write_text("---\nlicense: mit\npipeline_tag: sentence-similarity\n---\n# x\n")
    assert detect_task(tmp_path) == "embed"
    card.write_text("# no front matter\npipeline_tag: text-ranking\n")
    assert detect_task(tmp_path) == "generate"
    # a checkpoint saved from the bare decoder is an embedding model
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3Model"]}))
    assert detect_task(tmp_path) == "embed"


# ---- embeddings ----

def test_embeddings_equal_transformers_last_token_pooling(embedding_dir, embedder):
    ours = embeddings(embedder.embed(TEXTS, use_tqdm=False))
    ref = transformers_embeddings(embedding_dir, TEXTS)
    assert ours.shape == ref.shape == (len(TEXTS), 64)
    assert torch.allclose(ours.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-6)
    assert F.cosine_similarity(ours, ref).min() > 0.99999
    assert (ours - ref).abs().max() < 1e-4


def test_embeddings_equal_sentence_transformers_with_its_query_prompt(embedding_dir, embedder):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(embedding_dir), device="cpu")
    for prompt_name in ("query", "document"):
        ref = st.encode(TEXTS, prompt_name=prompt_name, convert_to_tensor=True)
        outs = embedder.embed(TEXTS, prompt_name=prompt_name, use_tqdm=False)
        assert (embeddings(outs) - ref).abs().max() < 1e-4, prompt_name
    # the same token ids sentence-transformers feeds: the prompt, the text and the tokenizer's
    # end-of-text token
    ids = st.tokenizer([EMBEDDING_QUERY_PROMPT + TEXTS[0]])["input_ids"][0]
    assert outs[0].prompt_token_ids != ids  # (outs are the "document" ones: no prompt)
    assert embedder.embed(TEXTS[0], prompt_name="query", use_tqdm=False)[0].prompt_token_ids == ids
    assert ids[-1] == 151643
    query = embeddings(embedder.embed(TEXTS, prompt_name="query", use_tqdm=False))
    assert (query - embeddings(outs)).abs().max() > 1e-3  # the prompt changes the vectors


def test_dimensions_keep_the_first_values_renormalised(embedding_dir, embedder):
    from sentence_transformers import SentenceTransformer

    full = embeddings(embedder.embed(TEXTS, use_tqdm=False, dimensions=None))
    cut = embeddings(embedder.embed(TEXTS, use_tqdm=False, dimensions=16))
    assert cut.shape == (len(TEXTS), 16)
    assert torch.allclose(cut, F.normalize(full[:, :16], dim=1), atol=1e-6)
    # sentence-transformers cuts after its Normalize module; renormalised, it is the same vector
    st = SentenceTransformer(str(embedding_dir), device="cpu", truncate_dim=16)
    assert (cut - F.normalize(st.encode(TEXTS, convert_to_tensor=True), dim=1)).abs().max() < 1e-4
    raw = embeddings(embedder.embed(TEXTS, PoolingParams(normalize=False), use_tqdm=False))
    assert raw.norm(dim=1).min() > 1.5  # not normalised: the final norm's scale
    assert torch.allclose(F.normalize(raw, dim=1), full, atol=1e-6)


def test_batching_chunking_and_prefix_hits_do_not_change_a_vector(embedding_dir, embedder):
    alone = torch.cat([embeddings(embedder.embed([t], use_tqdm=False)) for t in TEXTS])
    batched = embeddings(embedder.embed(TEXTS, use_tqdm=False))
    assert (alone - batched).abs().max() < 1e-5
    # prompts cut into 8-token chunks over several steps, several sequences per step
    chunked = make_llm(embedding_dir, max_model_len=256, kv_cache_memory=16 << 20,
                       max_num_batched_tokens=8)
    assert (embeddings(chunked.embed(TEXTS, use_tqdm=False)) - batched).abs().max() < 1e-5
    # a shared instruction is computed once: the second time its blocks come from the cache
    texts = [f"{EMBEDDING_QUERY_PROMPT}{t}" for t in TEXTS]
    first = embedder.embed(texts[:1], use_tqdm=False)
    again = embedder.embed(texts, use_tqdm=False)
    assert min(o.num_cached_tokens for o in again) >= 16
    assert (embeddings(again)[:1] - embeddings(first)).abs().max() < 1e-5
    # and nothing stays in the KV cache after the requests
    bm = embedder.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_token_id_inputs_are_embedded_as_given(embedder):
    ids = embedder.embed(TEXTS[0], use_tqdm=False)[0].prompt_token_ids
    again = embedder.embed([ids], use_tqdm=False)[0]
    assert again.prompt_token_ids == ids
    assert again.outputs.embedding == pytest.approx(
        embedder.embed(TEXTS[0], use_tqdm=False)[0].outputs.embedding, abs=1e-6)


def test_int8_embeddings_stay_close(embedding_dir, embedder):
    int8 = make_llm(embedding_dir, max_model_len=256, kv_cache_memory=16 << 20,
                    quantization="int8", enforce_eager=True)
    cos = F.cosine_similarity(embeddings(int8.embed(TEXTS, use_tqdm=False)),
                              embeddings(embedder.embed(TEXTS, use_tqdm=False)))
    assert cos.min() > 0.99


# ---- reranking ----

def test_scores_equal_the_model_card_recipe(reranker_dir, reranker):
    ours = torch.tensor([o.outputs.score for o in reranker.score(QUERY, DOCUMENTS, use_tqdm=False)])
    ref = model_card_scores(reranker_dir, QUERY, DOCUMENTS)
    assert (ours - ref).abs().max() < 1e-4
    assert ref.max() - ref.min() > 0.01  # the documents do score differently
    instruction = "Find the document that names a city"
    ours = torch.tensor([o.outputs.score for o in reranker.score(
        QUERY, DOCUMENTS, instruction=instruction, use_tqdm=False)])
    assert (ours - model_card_scores(reranker_dir, QUERY, DOCUMENTS, instruction)).abs().max() < 1e-4


def test_scores_come_from_two_head_rows_of_an_untied_reranker(tmp_path):
    raw = {**preset_config("reranker-tiny"), "tie_word_embeddings": False}
    model_dir = write_random_model(tmp_path, raw, dtype="float32", std=0.1, task="score")
    llm = make_llm(model_dir, max_model_len=256)
    assert llm.llm_engine.model.lm_head is None  # the other 151667 rows are dropped
    ours = torch.tensor([o.outputs.score for o in llm.score(QUERY, DOCUMENTS, use_tqdm=False)])
    assert (ours - model_card_scores(model_dir, QUERY, DOCUMENTS)).abs().max() < 1e-4


def test_a_shared_query_prefix_is_computed_once(reranker):
    first = reranker.score(QUERY, DOCUMENTS[:1], use_tqdm=False)
    again = reranker.score(QUERY, DOCUMENTS, use_tqdm=False)
    assert min(o.num_cached_tokens for o in again) >= 32  # system line, instruction and query
    assert again[0].outputs.score == pytest.approx(first[0].outputs.score, abs=1e-6)


# ---- checkpoint layouts ----

def test_embedding_weights_load_with_or_without_the_model_prefix_and_head(embedding_dir, embedder,
                                                                           tmp_path):
    """Qwen3-Embedding is saved from the bare decoder (no "model." prefix, no head); the same
    weights saved as a causal LM, with a head, load for embedding too."""
    tensors = load_file(embedding_dir / "model.safetensors")
    assert "embed_tokens.weight" in tensors and "lm_head.weight" not in tensors
    prefixed = tmp_path / "prefixed"
    shutil.copytree(embedding_dir, prefixed)
    prefixed_tensors = {f"model.{k}": v for k, v in tensors.items()}
    prefixed_tensors["lm_head.weight"] = torch.randn_like(tensors["embed_tokens.weight"])
    save_file(prefixed_tensors, prefixed / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((prefixed / "config.json").read_text())
    (prefixed / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    llm = make_llm(prefixed, max_model_len=256)
    assert (embeddings(llm.embed(TEXTS, use_tqdm=False))
            - embeddings(embedder.embed(TEXTS, use_tqdm=False))).abs().max() < 1e-6
    # a generative load of the bare checkpoint still needs its head: the tied one is the embedding
    gen = make_llm(embedding_dir, max_model_len=256, task="generate")
    out = gen.generate([[9707, 11]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(out[0].token_ids) == 2


# ---- bad input ----

def test_wrong_task_and_bad_input_are_clear_errors(embedder, reranker, tiny_dir):
    with pytest.raises(InvalidRequestError, match="embedding model.*does not generate.*embed"):
        embedder.generate("hello", use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="reranker model.*does not generate.*score"):
        reranker.generate("hello", use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="embed needs an embedding model"):
        reranker.embed("hello", use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="score needs a reranker"):
        embedder.score("q", ["d"], use_tqdm=False)
    generative = make_llm(tiny_dir)
    with pytest.raises(InvalidRequestError, match="generative model.*does not embed"):
        generative.embed("hello", use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="prompt_name 'passage' is not one of.*'query'"):
        embedder.embed("hello", prompt_name="passage", use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="dimensions=65 is more than this model's 64"):
        embedder.embed("hello", dimensions=65, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="dimensions=0 is invalid"):
        embedder.embed("hello", dimensions=0, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        embedder.embed([[]], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="documents must be strings"):
        reranker.score(QUERY, ["ok", 3], use_tqdm=False)
    assert not embedder.llm_engine.has_unfinished_requests()  # nothing half-queued


def test_long_inputs_are_rejected_unless_truncation_is_asked(embedder):
    long_text = "word " * 300  # > max_model_len 256 tokens
    with pytest.raises(InvalidRequestError, match="has 30[0-2] tokens but max_model_len is 256.*"
                                                  "truncate_prompt_tokens"):
        embedder.embed(long_text, use_tqdm=False)
    out = embedder.embed(long_text, PoolingParams(truncate_prompt_tokens=100), use_tqdm=False)[0]
    full_ids = embedder.llm_engine.tokenizer.encode(long_text, add_special_tokens=True)
    assert out.prompt_token_ids == full_ids[-100:]  # the last 100, end-of-text token included
    exact = embedder.embed([full_ids[-100:]], use_tqdm=False)[0]
    assert out.outputs.embedding == pytest.approx(exact.outputs.embedding, abs=1e-6)
    # an input may fill the whole context: nothing is generated after it
    assert len(embedder.embed([full_ids[:256]], use_tqdm=False)[0].outputs.embedding) == 64
