"""The server's embedding and reranking endpoints (/v1/embeddings, /v1/rerank, /score) on random
Qwen3-Embedding / Qwen3-Reranker checkpoints: in-process apps driven with the `openai` client and
httpx, every answer compared with the offline API (`LLM.embed`, `LLM.score`), the 400s bad inputs
get, and `nanoqwen serve` choosing the task from the checkpoint or --task."""

from __future__ import annotations

import base64
import contextlib
import re
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from fastapi.testclient import TestClient

from nanoqwen import LLM
from nanoqwen.config.engine import EngineConfig
from nanoqwen.distributed import free_port
from nanoqwen.engine.llm_engine import LLMEngine
from nanoqwen.entrypoints.server import build_app
from nanoqwen.errors import InvalidRequestError
from nanoqwen.model_loader.init_random import write_random_model
from nanoqwen.pooling_params import PoolingParams

pytestmark = pytest.mark.timeout(120)
EMBED_LEN, RERANK_LEN = 64, 128  # max_model_len: a reranker's prompt alone is ~74 tokens
OPTIONS = {"device": "cpu", "dtype": "float32", "enforce_eager": True, "kv_cache_memory": 64 << 20}
TEXTS = ["The capital of France is Paris.", "Tea is a drink.", "hi"]
QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "Berlin is in Germany.",
        "The Eiffel tower is in Paris."]
LONG = "word " * 200  # over both contexts


# ---------------------------------------------------------------- apps and references


@pytest.fixture(scope="module")
def embed_dir(tmp_path_factory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("embed"), "embedding-tiny", dtype="float32",
                              std=0.05)


@pytest.fixture(scope="module")
def rerank_dir(tmp_path_factory) -> Path:
    return write_random_model(tmp_path_factory.mktemp("rerank"), "reranker-tiny",
                              dtype="float32", std=0.05)


@contextlib.contextmanager
def app(model_dir: Path, max_model_len: int, **build: object) -> Iterator[tuple]:
    """(engine, TestClient, openai client) over an in-process app; the engine loop runs inside."""
    engine = LLMEngine(EngineConfig(str(model_dir), max_model_len=max_model_len, **OPTIONS))
    with TestClient(build_app(engine, "m", **build)) as http:
        yield engine, http, openai.OpenAI(base_url="http://testserver/v1", api_key="none",
                                          http_client=http, max_retries=0)


@pytest.fixture(scope="module")
def embed(embed_dir):
    # max_waiting=2: one request's many inputs still queue together (admitted once)
    with app(embed_dir, EMBED_LEN, max_waiting=2) as a:
        yield a


@pytest.fixture(scope="module")
def rerank(rerank_dir):
    with app(rerank_dir, RERANK_LEN) as a:
        yield a


@pytest.fixture(scope="module")
def generate(checkpoint):
    with app(checkpoint("tiny"), 128) as a:
        yield a


@pytest.fixture(scope="module")
def embed_llm(embed_dir) -> LLM:
    return LLM(embed_dir, max_model_len=EMBED_LEN, **OPTIONS)


@pytest.fixture(scope="module")
def rerank_llm(rerank_dir) -> LLM:
    return LLM(rerank_dir, max_model_len=RERANK_LEN, **OPTIONS)


def vectors(llm: LLM, inputs, **kwargs) -> torch.Tensor:
    """LLM.embed's embeddings [N, d]."""
    return torch.tensor([o.outputs.embedding for o in llm.embed(inputs, use_tqdm=False, **kwargs)])


def scores(llm: LLM, query: str, documents: list[str], **kwargs) -> list[float]:
    return [o.outputs.score for o in llm.score(query, documents, use_tqdm=False, **kwargs)]


def close(a, b) -> bool:
    # batches of different sizes sum in different orders: float32 rounding apart
    return torch.allclose(torch.as_tensor(a), torch.as_tensor(b), atol=1e-5, rtol=0)


def error(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def assert_idle(engine: LLMEngine, http: TestClient) -> None:
    """Nothing left in the engine or the server: every input finished or was aborted."""
    deadline = time.monotonic() + 5
    while engine.has_unfinished_requests() or http.app.state.server.async_engine.streams:
        assert time.monotonic() < deadline, "requests were left in the engine"
        time.sleep(0.01)
    assert engine.kv_cache_stats["used_blocks"] == 0


# ---------------------------------------------------------------- /v1/embeddings


def test_embeddings_float_equal_llm_embed(embed, embed_llm):
    _, http, client = embed
    r = client.embeddings.create(model="m", input=TEXTS, encoding_format="float")
    assert r.object == "list" and r.model == "m" and [d.index for d in r.data] == [0, 1, 2]
    assert all(d.object == "embedding" for d in r.data)
    assert close([d.embedding for d in r.data], vectors(embed_llm, TEXTS))
    ref_tokens = sum(len(o.prompt_token_ids) for o in embed_llm.embed(TEXTS, use_tqdm=False))
    assert r.usage.prompt_tokens == r.usage.total_tokens == ref_tokens
    raw = http.post("/v1/embeddings", json={"input": "hi"}).json()  # one string, float by default
    assert raw["id"].startswith("embd-") and isinstance(raw["created"], int)
    assert close(raw["data"][0]["embedding"], r.data[2].embedding)


def test_embeddings_base64_is_float32_little_endian(embed):
    _, http, client = embed
    floats = [d.embedding for d in client.embeddings.create(model="m", input=TEXTS,
                                                              encoding_format="float").data]
    # the openai client asks for base64 unless told otherwise, and then decodes it itself
    decoded = client.embeddings.create(model="m", input=TEXTS).data
    assert [d.embedding for d in decoded] == floats  # float32 exactly
    # asked for, base64 reaches the caller as it is
    encoded = client.embeddings.create(model="m", input=TEXTS, encoding_format="base64").data
    raw = http.post("/v1/embeddings", json={"input": TEXTS, "encoding_format": "base64"}).json()
    assert [d.embedding for d in encoded] == [d["embedding"] for d in raw["data"]]
    for text, vector in zip(encoded, floats, strict=True):
        packed = base64.b64decode(text.embedding)
        assert list(struct.unpack(f"<{len(packed) // 4}f", packed)) == vector


def test_token_id_inputs_equal_the_same_text(embed, embed_llm):
    _, _, client = embed
    # the tokenizer's ids, end-of-text appended
    ids = [embed_llm.llm_engine.input_processor.embedding_input(t) for t in TEXTS]
    expected = vectors(embed_llm, TEXTS)
    many = client.embeddings.create(model="m", input=ids, encoding_format="float")
    assert close([d.embedding for d in many.data], expected)
    assert many.usage.prompt_tokens == sum(map(len, ids))
    one = client.embeddings.create(model="m", input=ids[0], encoding_format="float")
    assert len(one.data) == 1 and close(one.data[0].embedding, expected[0])


def test_dimensions_keep_the_first_values_renormalised(embed, embed_llm):
    _, _, client = embed
    full = vectors(embed_llm, TEXTS)
    r = client.embeddings.create(model="m", input=TEXTS, dimensions=8, encoding_format="float")
    got = torch.tensor([d.embedding for d in r.data])
    assert got.shape == (3, 8)
    assert close(got, torch.nn.functional.normalize(full[:, :8], dim=-1))
    assert close(got.norm(dim=-1), torch.ones(3))


def test_prompt_name_puts_the_checkpoints_prompt_first(embed, embed_llm):
    _, http, _ = embed
    r = http.post("/v1/embeddings", json={"input": TEXTS[:1], "prompt_name": "query"}).json()
    with_prompt = vectors(embed_llm, TEXTS[:1], prompt_name="query")
    assert close(r["data"][0]["embedding"], with_prompt[0])
    assert not close(with_prompt, vectors(embed_llm, TEXTS[:1]))
    assert r["usage"]["prompt_tokens"] > len(embed_llm.embed(TEXTS[0], use_tqdm=False)[0]
                                             .prompt_token_ids)


def test_truncate_prompt_tokens_lets_a_long_input_through(embed, embed_llm):
    _, http, _ = embed
    too_long = error(http.post("/v1/embeddings", json={"input": ["ok", LONG]}))
    assert re.fullmatch(rf"input\[1\]: the input has \d+ tokens but max_model_len is {EMBED_LEN}"
                        r": .*truncate_prompt_tokens.*", too_long["message"])
    assert too_long["param"] == "input"
    r = http.post("/v1/embeddings", json={"input": LONG, "truncate_prompt_tokens": 20})
    body = r.json()
    assert r.status_code == 200 and body["usage"]["prompt_tokens"] == 20
    last_20 = vectors(embed_llm, LONG, pooling_params=PoolingParams(truncate_prompt_tokens=20))
    assert close(body["data"][0]["embedding"], last_20[0])
    whole = http.post("/v1/embeddings", json={"input": LONG, "truncate_prompt_tokens": -1}).json()
    assert whole["usage"]["prompt_tokens"] == EMBED_LEN


def test_inputs_of_one_request_batch_together(embed, monkeypatch):
    """All inputs are queued at once (not one after another): the engine holds several together,
    though max_waiting is 2."""
    engine, http, _ = embed
    held = []
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: held.append(len(engine.requests)) or step())
    r = http.post("/v1/embeddings", json={"input": [f"text number {i}" for i in range(8)]})
    assert r.status_code == 200 and [d["index"] for d in r.json()["data"]] == list(range(8))
    assert max(held) > 1


def test_an_input_the_engine_rejects_aborts_the_others(embed, monkeypatch):
    """The engine takes the other inputs but makes no progress on them: only aborting them empties
    it."""
    engine, http, _ = embed
    add = engine.add_request

    def add_request(request_id, *args, **kwargs):
        if request_id.endswith("-2"):
            raise InvalidRequestError("input rejected by the engine")
        return add(request_id, *args, **kwargs)

    monkeypatch.setattr(engine, "add_request", add_request)
    monkeypatch.setattr(engine, "step", lambda: [])
    before = metric(http, 'nanoqwen_requests_finished_total{finish_reason="error"}')
    err = error(http.post("/v1/embeddings", json={"input": TEXTS * 2}))
    assert err["message"] == "input rejected by the engine"
    assert_idle(engine, http)
    assert metric(http, 'nanoqwen_requests_finished_total{finish_reason="error"}') == before + 1


BAD_EMBEDDINGS = [
    ({"input": []}, "input", r"input is an empty list: give at least one text or token-id list"),
    ({"input": 5}, "input", r"input: must be a string, a list of strings, a list of token ids or "
                            r"a list of token-id lists \(got 5\)"),
    ({"input": ["a", 1]}, "input", r"input: must be a string, .*\(got \['a', 1\]\)"),
    ({"input": [[1, 2], [3, 999999]]}, "input",
     r"input\[1\]: prompt token id 999999 is not in the vocabulary \[0, 151669\)"),
    ({"input": [[]]}, "input", r"input\[0\]: the prompt is empty.*"),
    ({"input": LONG}, "input",
     rf"input: the input has \d+ tokens but max_model_len is {EMBED_LEN}.*"),
    ({"input": "a", "dimensions": 65}, "dimensions",
     r"dimensions=65 is more than this model's 64: ask for 1 to 64"),
    ({"input": "a", "dimensions": 0}, "dimensions",
     r"dimensions: Input should be greater than or equal to 1 \(got 0\)"),
    ({"input": "a", "prompt_name": "passage"}, "prompt_name",
     r"prompt_name 'passage' is not one of this model's prompts .*'query', 'document'.*"),
    ({"input": "a", "encoding_format": "hex"}, "encoding_format", r"encoding_format: .*"),
    ({"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens",
     rf"truncate_prompt_tokens=0 is out of range: give 1 to {EMBED_LEN} .*"),
    ({"input": "a", "truncate_prompt_tokens": EMBED_LEN + 1}, "truncate_prompt_tokens",
     rf"truncate_prompt_tokens={EMBED_LEN + 1} is out of range.*"),
]


@pytest.mark.parametrize(("body", "param", "message"), BAD_EMBEDDINGS,
                         ids=[str(i) for i in range(len(BAD_EMBEDDINGS))])
def test_bad_embedding_requests_are_400s_that_name_the_field(embed, body, param, message):
    engine, http, _ = embed
    err = error(http.post("/v1/embeddings", json=body))
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert re.fullmatch(message, err["message"]), err["message"]
    assert_idle(engine, http)


def test_the_openai_client_sees_a_bad_request(embed):
    _, _, client = embed
    with pytest.raises(openai.BadRequestError, match="input is an empty list"):
        client.embeddings.create(model="m", input=[])
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.embeddings.create(model="other", input="a")


# ---------------------------------------------------------------- /v1/rerank and /score


def test_rerank_sorts_by_the_rerankers_scores(rerank, rerank_llm):
    _, http, _ = rerank
    ref = scores(rerank_llm, QUERY, DOCS)
    best = sorted(range(len(DOCS)), key=lambda i: -ref[i])
    gaps = [ref[best[k]] - ref[best[k + 1]] for k in range(len(DOCS) - 1)]
    assert min(gaps) > 1e-4  # (the random model's order is not a rounding accident)
    tokens = sum(len(o.prompt_token_ids) for o in rerank_llm.score(QUERY, DOCS, use_tqdm=False))
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        body = http.post(path, json={"query": QUERY, "documents": DOCS, "top_n": 3}).json()
        assert body["id"].startswith("rerank-") and body["model"] == "m"
        assert body["usage"] == {"total_tokens": tokens}  # every document was scored
        results = body["results"]
        assert [r["index"] for r in results] == best[:3]
        assert [r["document"] for r in results] == [{"text": DOCS[i]} for i in best[:3]]
        assert close([r["relevance_score"] for r in results], [ref[i] for i in best[:3]])
    everything = http.post("/v1/rerank", json={"query": QUERY, "documents": DOCS}).json()
    assert [r["index"] for r in everything["results"]] == best


def test_rerank_instruction_equals_llm_score_with_it(rerank, rerank_llm):
    _, http, _ = rerank
    instruction = "Given a question, find the fruit"
    ref = scores(rerank_llm, QUERY, DOCS, instruction=instruction)
    assert not close(ref, scores(rerank_llm, QUERY, DOCS))
    body = http.post("/v1/rerank", json={"query": QUERY, "documents": DOCS,
                                         "instruction": instruction}).json()
    assert close([ref[r["index"]] for r in body["results"]],
                 [r["relevance_score"] for r in body["results"]])


def test_score_one_against_many_and_pair_by_pair(rerank, rerank_llm):
    _, http, _ = rerank
    one_to_many = scores(rerank_llm, QUERY, DOCS)
    for path in ("/score", "/v1/score"):
        body = http.post(path, json={"text_1": QUERY, "text_2": DOCS}).json()
        assert body["object"] == "list" and body["id"].startswith("score-")
        assert [(d["index"], d["object"]) for d in body["data"]] == [(i, "score")
                                                                    for i in range(len(DOCS))]
        assert close([d["score"] for d in body["data"]], one_to_many)
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    queries = [QUERY, "Which fruit is yellow?"]
    pairwise = [scores(rerank_llm, q, [d])[0] for q, d in zip(queries, DOCS[:2], strict=True)]
    body = http.post("/score", json={"text_1": queries, "text_2": DOCS[:2]}).json()
    assert close([d["score"] for d in body["data"]], pairwise)
    single = http.post("/score", json={"text_1": [QUERY], "text_2": DOCS[1]}).json()
    assert close([d["score"] for d in single["data"]], one_to_many[1:2])


def test_rerank_truncate_prompt_tokens_lets_a_long_document_through(rerank, rerank_llm):
    _, http, _ = rerank
    err = error(http.post("/v1/rerank", json={"query": QUERY, "documents": ["short", LONG]}))
    assert re.fullmatch(rf"query with documents\[1\]: the input has \d+ tokens but max_model_len "
                        rf"is {RERANK_LEN}: .*", err["message"])
    body = http.post("/v1/rerank", json={"query": QUERY, "documents": [LONG],
                                         "truncate_prompt_tokens": 100}).json()
    assert body["usage"]["total_tokens"] == 100
    last_100 = PoolingParams(truncate_prompt_tokens=100)
    ref = scores(rerank_llm, QUERY, [LONG], pooling_params=last_100)
    assert close(body["results"][0]["relevance_score"], ref[0])


BAD_SCORES = [
    ("/v1/rerank", {"query": QUERY, "documents": []}, "documents", r"documents: List should have "
                                                                   r"at least 1 item.*"),
    ("/v1/rerank", {"documents": DOCS}, "query", r"query: Field required.*"),
    ("/v1/rerank", {"query": QUERY, "documents": [1]}, "documents",
     r"documents\.0: Input should be a valid string.*"),
    ("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n",
     r"top_n: Input should be greater than or equal to 0.*"),
    ("/score", {"text_1": QUERY, "text_2": []}, "text_2",
     r"text_2 is an empty list: give at least one text"),
    ("/score", {"text_1": 3, "text_2": "a"}, "text_1",
     r"text_1: must be a string or a list of strings \(got 3\)"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2",
     r"text_1 has 2 texts and text_2 has 3: give one text_1 for any number of text_2, or lists of "
     r"the same length \(scored pair by pair\)"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["a", LONG]}, "text_2",
     rf"text_1\[1\] with text_2\[1\]: the input has \d+ tokens but max_model_len is "
     rf"{RERANK_LEN}.*"),
]


@pytest.mark.parametrize(("path", "body", "param", "message"), BAD_SCORES,
                         ids=[str(i) for i in range(len(BAD_SCORES))])
def test_bad_rerank_and_score_requests_are_400s(rerank, path, body, param, message):
    engine, http, _ = rerank
    err = error(http.post(path, json=body))
    assert err["param"] == param and re.fullmatch(message, err["message"]), err
    assert_idle(engine, http)


# ---------------------------------------------------------------- tasks, models, metrics

USE_EMBEDDINGS = "this server serves an embedding model: use POST /v1/embeddings"
USE_RERANK = "this server serves a reranker model: use POST /v1/rerank or /score"
USE_GENERATE = ("this server serves a generative model: use POST /v1/chat/completions or "
                "/v1/completions")
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
WRONG_TASK = [  # (server, path, body, message)
    ("embed", "/v1/chat/completions", CHAT, USE_EMBEDDINGS),
    ("embed", "/v1/completions", {"prompt": "hi", "max_tokens": 2}, USE_EMBEDDINGS),
    ("embed", "/v1/rerank", {"query": "q", "documents": ["d"]}, USE_EMBEDDINGS),
    ("embed", "/score", {"text_1": "q", "text_2": "d"}, USE_EMBEDDINGS),
    ("rerank", "/v1/embeddings", {"input": "hi"}, USE_RERANK),
    ("rerank", "/v1/chat/completions", CHAT, USE_RERANK),
    ("generate", "/v1/embeddings", {"input": "hi"}, USE_GENERATE),
    ("generate", "/v1/rerank", {"query": "q", "documents": ["d"]}, USE_GENERATE),
    ("generate", "/score", {"text_1": "q", "text_2": "d"}, USE_GENERATE),
]


@pytest.mark.parametrize(("server", "path", "body", "message"), WRONG_TASK,
                         ids=[f"{s}{p}" for s, p, _, _ in WRONG_TASK])
def test_an_endpoint_of_another_task_is_a_400_naming_the_right_one(request, server, path, body,
                                                                  message):
    engine, http, _ = request.getfixturevalue(server)
    err = error(http.post(path, json=body))
    assert (err["message"], err["code"]) == (message, "wrong_task")
    assert_idle(engine, http)


def test_the_openai_client_hears_which_endpoint_to_use(embed, generate):
    with pytest.raises(openai.BadRequestError, match=re.escape(USE_EMBEDDINGS)):
        embed[2].chat.completions.create(model="m", messages=CHAT["messages"])
    with pytest.raises(openai.BadRequestError, match=re.escape(USE_GENERATE)):
        generate[2].embeddings.create(model="m", input="hi")
    # the generative server still generates
    r = generate[2].completions.create(model="m", prompt="hi", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


def test_models_list_the_task(embed, rerank, generate):
    for (_, http, client), task in ((embed, "embed"), (rerank, "score"), (generate, "generate")):
        [model] = client.models.list().data
        assert model.id == "m" and model.model_extra["task"] == task
        assert http.get("/v1/models").json()["data"][0]["task"] == task


def metric(http: TestClient, name: str) -> float:
    """One sample of /metrics (0 if absent)."""
    text = http.get("/metrics").text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_metrics_count_the_new_endpoints_and_their_tokens(rerank):
    _, http, _ = rerank
    names = {"ok_rerank": 'nanoqwen_http_requests_total{endpoint="/v1/rerank",status="200"}',
             "ok_alias": 'nanoqwen_http_requests_total{endpoint="/rerank",status="200"}',
             "ok_score": 'nanoqwen_http_requests_total{endpoint="/score",status="200"}',
             "bad_score": 'nanoqwen_http_requests_total{endpoint="/score",status="400"}',
             "prompt": "nanoqwen_prompt_tokens_total",
             "generated": "nanoqwen_generation_tokens_total",
             "stop": 'nanoqwen_requests_finished_total{finish_reason="stop"}'}
    before = {k: metric(http, n) for k, n in names.items()}
    a = http.post("/v1/rerank", json={"query": QUERY, "documents": DOCS}).json()
    b = http.post("/rerank", json={"query": QUERY, "documents": DOCS[:1]}).json()
    c = http.post("/score", json={"text_1": QUERY, "text_2": DOCS[:2]}).json()
    http.post("/score", json={"text_1": QUERY, "text_2": []})
    after = {k: metric(http, n) for k, n in names.items()}
    grew = {k: after[k] - before[k] for k in names}
    tokens = a["usage"]["total_tokens"] + b["usage"]["total_tokens"] + c["usage"]["total_tokens"]
    assert grew == {"ok_rerank": 1, "ok_alias": 1, "ok_score": 1, "bad_score": 1, "prompt": tokens,
                    "generated": 0, "stop": 3}


# ---------------------------------------------------------------- `nanoqwen serve`


@contextlib.contextmanager
def serve(model_dir: Path, *flags: str) -> Iterator[str]:
    """A `nanoqwen serve` process; its base URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "nanoqwen", "serve", "--model", str(model_dir), "--port",
           str(port), "--dtype", "float32", "--device", "cpu", "--max-model-len", "256",
           "--kv-cache-memory", "32MiB", "--enforce-eager", "--served-model-name", "m", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"server did not start:\n{proc.communicate()[0]}")
            time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def test_serve_picks_the_task_from_the_checkpoint_or_task(rerank_dir, rerank_llm, checkpoint):
    with serve(rerank_dir) as base:  # a reranker's model card says pipeline_tag: text-ranking
        assert httpx.get(f"{base}/v1/models").json()["data"][0]["task"] == "score"
        body = httpx.post(f"{base}/v1/rerank", json={"query": QUERY, "documents": DOCS}).json()
        got = {r["index"]: r["relevance_score"] for r in body["results"]}
        assert close([got[i] for i in range(len(DOCS))], scores(rerank_llm, QUERY, DOCS))
    tiny = checkpoint("tiny")  # a generative checkpoint, served as an embedding model
    with serve(tiny, "--task", "embed") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        r = client.embeddings.create(model="m", input=TEXTS)
        ref = LLM(tiny, task="embed", max_model_len=256, **OPTIONS)
        assert close([d.embedding for d in r.data], vectors(ref, TEXTS))
        with pytest.raises(openai.BadRequestError, match=re.escape(USE_EMBEDDINGS)):
            client.completions.create(model="m", prompt="hi", max_tokens=2)
