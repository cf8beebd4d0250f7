"""/openapi.json describes every endpoint the server serves, and a fuzzer driven by it (schemathesis)
finds no 5xx, no answer outside the documented statuses and schemas, no schema-breaking body
accepted, and leaves no request in the engine. Apps run in-process on random tiny checkpoints
(generative, embedding, reranker)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from nanoqwen.config.engine import EngineConfig
from nanoqwen.engine.llm_engine import LLMEngine
from nanoqwen.entrypoints.server import build_app
from nanoqwen.model_loader.init_random import write_random_model

jsonschema = pytest.importorskip("jsonschema")
schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, example, given, settings  # noqa: E402  (comes with schemathesis)
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

pytestmark = pytest.mark.timeout(180)
NAME = "m"
OPTIONS = {"device": "cpu", "dtype": "float32", "enforce_eager": True, "kv_cache_memory": 16 << 20}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, negative_data_rejection]
# n sequences over the real 152K vocabulary cost n samples per step on a CPU: the fuzzer's valid
# requests ask for few (invalid ones keep the whole range, to check n > 128 is refused)
MAX_N = 2
REQUEST_TIMEOUT = 20  # seconds; a request that hangs fails the test instead of blocking it
# failure reports show bodies as sent (not max_tokens as "[Filtered]": "token" marks a secret)
CONFIG = schemathesis.config.SchemathesisConfig.from_dict({"output": {"sanitization": {"enabled": False}}})


class App:
    """An app over an engine, with the operations schemathesis reads from its /openapi.json."""

    def __init__(self, model_dir: Path, max_model_len: int, **build: Any) -> None:
        config = EngineConfig(str(model_dir), max_model_len=max_model_len, **OPTIONS)
        self.engine = LLMEngine(config)
        self.app = build_app(self.engine, NAME, **build)
        # schemathesis starts the app's lifespan (the engine loop) on its first request, and its
        # pytest plugin ends it after each test
        self.schema = schemathesis.openapi.from_asgi("/openapi.json", self.app, config=CONFIG)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Every request finished or was aborted, and every KV block is free again (an abort
        reaches the engine loop a moment after the response ends)."""
        streams = self.app.state.server.async_engine.streams
        deadline = time.monotonic() + timeout
        while self.engine.has_unfinished_requests() or streams:
            assert time.monotonic() < deadline, f"requests left running: {list(streams)}"
            time.sleep(0.01)
        assert self.engine.kv_cache_stats["used_blocks"] == 0


@pytest.fixture(scope="module")
def generative(checkpoint) -> App:
    return App(checkpoint("tiny", dtype="float32"), 64)


@pytest.fixture(scope="module")
def embedding(tmp_path_factory) -> App:
    folder = tmp_path_factory.mktemp("embed")
    return App(write_random_model(folder, "embedding-tiny", dtype="float32", std=0.05), 64)


@pytest.fixture(scope="module")
def reranker(tmp_path_factory) -> App:
    # a reranker's prompt template alone is ~74 tokens
    folder = tmp_path_factory.mktemp("rerank")
    return App(write_random_model(folder, "reranker-tiny", dtype="float32", std=0.05), 128)


# ---------------------------------------------------------------- the document


def openapi(app: Any) -> dict[str, Any]:
    # no lifespan: the document needs no engine loop
    response = TestClient(app).get("/openapi.json")
    assert response.status_code == 200
    return response.json()


def request_schema(doc: dict[str, Any], path: str) -> dict[str, Any]:
    """The JSON schema of a POST endpoint's body, resolvable on its own."""
    body = doc["paths"][path]["post"]["requestBody"]
    assert body["required"] is True
    return {**body["content"]["application/json"]["schema"], "components": doc["components"]}


def refs(value: Any) -> list[str]:
    """Every $ref in a JSON value."""
    if isinstance(value, dict):
        own = [value["$ref"]] if "$ref" in value else []
        return own + [r for v in value.values() for r in refs(v)]
    if isinstance(value, list):
        return [r for v in value for r in refs(v)]
    return []


GOOD_AND_BAD = {
    "/v1/chat/completions": ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                              "stream": True, "stop": ["\n"]},
                             {"messages": [{"role": "robot", "content": "hi"}]}),
    "/v1/completions": ({"prompt": [1, 2, 3], "n": 2, "logprobs": 1}, {"prompt": 3}),
    "/v1/embeddings": ({"input": ["a", "b"], "encoding_format": "base64"}, {"input": {"a": 1}}),
    "/v1/rerank": ({"query": "q", "documents": ["a"], "top_n": 1}, {"query": "q", "documents": []}),
    "/score": ({"text_1": "a", "text_2": ["b", "c"]}, {"text_1": "a"}),
    "/v1/responses": ({"input": "hi", "max_output_tokens": 4, "stream": True}, {"input": 3}),
    "/v1/messages": ({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "stream": True},
                     {"model": "m", "messages": [{"role": "robot", "content": "hi"}]}),
    "/tokenize": ({"messages": [{"role": "user", "content": "hi"}], "return_token_strs": True}, {"prompt": 3}),
    "/detokenize": ({"tokens": [1, 2]}, {"tokens": "12"}),
}


def test_openapi_describes_every_route(generative):
    # a second app over the same engine, with an API key (its engine loop never starts)
    app = build_app(generative.engine, NAME, api_key="sesame")
    doc = openapi(app)
    served = {(method, route.path) for route in app.routes
              if isinstance(route, APIRoute) and route.include_in_schema
              for method in route.methods}
    documented = {(method.upper(), path) for path, item in doc["paths"].items() for method in item}
    assert served == documented
    assert {path for _, path in served} == {
        "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/rerank", "/v2/rerank",
        "/rerank", "/score", "/v1/score", "/v1/models", "/props", "/health", "/metrics", "/v1/responses",
        "/v1/responses/{response_id}", "/v1/messages", "/v1/messages/count_tokens", "/tokenize", "/detokenize",
        "/version", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
    plain_text = {"/metrics", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"}  # (vLLM's text answers)
    streamed = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"}
    for method, path in served:
        operation = doc["paths"][path][method.lower()]
        assert ("requestBody" in operation) == (method == "POST"), path
        ok = operation["responses"]["200"]["content"]
        assert ok.keys() == ({"text/plain"} if path in plain_text else
                             {"application/json", "text/event-stream"} if path in streamed and method == "POST"
                             else {"application/json"}), path
        # the API key guards everything but the probes, and its 401 is documented
        guarded = path not in ("/health", "/metrics", "/version")
        assert ("security" in operation) == guarded and ("401" in operation["responses"]) == guarded
        if method == "POST":
            # Anthropic's routes answer a full queue with its 529 overloaded_error
            busy = "529" if path.startswith("/v1/messages") else "503"
            assert {"400", "404", "413", busy} <= operation["responses"].keys(), path
    assert doc["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"
    for path, (good, bad) in GOOD_AND_BAD.items():
        validator = jsonschema.Draft202012Validator(request_schema(doc, path))
        validator.validate(good)
        assert not validator.is_valid(bad), path
        examples = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        for e in examples["examples"].values():
            validator.validate(e["value"])
    assert all(ref.removeprefix("#/components/schemas/") in doc["components"]["schemas"]
               for ref in refs(doc)), "a $ref without its schema"
    # the documents are public, as in vLLM, even with an API key
    http = TestClient(app)
    assert "swagger-ui" in http.get("/docs").text
    assert http.get("/v1/models").status_code == 401


# ---------------------------------------------------------------- the fuzzer


def whole_ints(value: Any) -> Any:
    """Whole floats as ints, all through a JSON value. schemathesis sends 2.0 for an integer half
    the time (JSON Schema's integers include it), and nanoqwen's strict models answer 400 (as they
    do "2"), so most valid requests would stop there instead of reaching the engine."""
    if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:
        return int(value)
    if isinstance(value, list):
        return [whole_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: whole_ints(v) for k, v in value.items()}
    return value


def positive(case: Any) -> Any:
    """A valid request that reaches the engine: the served model's name, few sequences, plain
    ints."""
    if isinstance(case.body, dict):
        body = whole_ints(case.body)
        if "model" in body:
            body["model"] = NAME
        if isinstance(body.get("n"), int):
            body["n"] = min(body["n"], MAX_N)
        case.body = body
    return case


# What a hostile client sends on top of a valid request: ids that overflow int64, JSON's Infinity and NaN, long
# lists (each must be a 400 naming the field, never a 5xx, and leave nothing in the engine)
HOSTILE_FIELDS = {
    "stop_token_ids": [[2**63], [-(2**63) - 1], [151936], list(range(2000))],
    "temperature": [float("inf"), float("nan")],
    "top_p": [float("nan"), float("-inf")],
    "presence_penalty": [float("inf")],
    "stop": [["x"] * 100, ["y" * 2000]],
    "max_tokens": [2**63, 2**64],
    "seed": [2**64],
    "n": [10**7],
}


def hostile(case: Any, field: str, value: Any) -> Any:
    """The case with `field` set to `value`, its body sent as the JSON text Python writes (Infinity and NaN
    included: an HTTP client would refuse to write them)."""
    if isinstance(case.body, dict):
        case.body = json.dumps({**case.body, field: value}).encode()
        case.headers = {**(case.headers or {}), "x-hostile-field": field}
    return case


def documented_examples(operation: Any) -> list[Any]:
    """The request bodies /openapi.json offers as examples, as cases."""
    content = operation.definition.raw.get("requestBody", {}).get("content", {})
    examples = content.get("application/json", {}).get("examples", {})
    return [operation.Case(body=e["value"], media_type="application/json")
            for e in examples.values()]


def fuzz(app: App, label: str, max_examples: int) -> None:
    """The documented examples, then valid and invalid requests to one operation, each checked
    (CHECKS), and the engine left idle after each."""
    operation = app.schema.find_operation_by_label(label)
    assert operation is not None, f"{label} is not in /openapi.json"
    cases = operation.as_strategy(GenerationMode.POSITIVE).map(positive)
    if label.startswith("POST"):  # an operation without a body has nothing to break
        cases = st.one_of(cases, operation.as_strategy(GenerationMode.NEGATIVE))
    if "completions" in label:
        hostile_values = st.sampled_from([(f, v) for f, values in HOSTILE_FIELDS.items() for v in values])
        cases = st.one_of(cases, st.tuples(operation.as_strategy(GenerationMode.POSITIVE).map(positive),
                                           hostile_values).map(lambda c: hostile(c[0], *c[1])))

    def check(case: Any) -> None:
        response = case.call_and_validate(checks=CHECKS, timeout=REQUEST_TIMEOUT)
        field = (case.headers or {}).get("x-hostile-field")
        if field is not None:  # refused (for that field, or for what else the generated request got wrong)
            assert response.status_code == 400, (field, response.text)
        # a stream's 200 is sent before the engine runs: a failure there is an error event
        assert '"type": "server_error"' not in response.text, response.text
        app.wait_idle()

    for case in documented_examples(operation):
        check = example(case=case)(check)
    # no shrinking: a failure reports the request that caused it (with a curl line), at once
    run = settings(max_examples=max_examples, deadline=None, database=None,
                   phases=[Phase.explicit, Phase.generate],
                   suppress_health_check=list(HealthCheck))(given(case=cases)(check))
    run()
    assert not app.engine.has_unfinished_requests()


@pytest.mark.parametrize("label, max_examples", [
    ("POST /v1/chat/completions", 100), ("POST /v1/completions", 80), ("POST /v1/embeddings", 5),
    ("GET /v1/models", 3), ("GET /props", 3), ("GET /health", 3), ("GET /metrics", 3), ("POST /tokenize", 40),
    ("POST /detokenize", 20), ("GET /version", 3), ("POST /v1/responses", 100),
    ("GET /v1/responses/{response_id}", 3), ("DELETE /v1/responses/{response_id}", 3), ("POST /v1/messages", 100),
    ("POST /v1/messages/count_tokens", 30)])
def test_fuzz_generative(generative, label, max_examples):
    fuzz(generative, label, max_examples)


@pytest.mark.parametrize("label, max_examples", [
    ("POST /v1/embeddings", 50), ("POST /v1/chat/completions", 5), ("POST /v1/rerank", 5), ("GET /props", 3)])
def test_fuzz_embedding(embedding, label, max_examples):
    fuzz(embedding, label, max_examples)


@pytest.mark.parametrize("label, max_examples", [
    ("POST /v1/rerank", 40), ("POST /score", 40), ("POST /rerank", 3), ("POST /v2/rerank", 3),
    ("POST /v1/score", 3), ("POST /v1/embeddings", 5)])
def test_fuzz_reranker(reranker, label, max_examples):
    fuzz(reranker, label, max_examples)
