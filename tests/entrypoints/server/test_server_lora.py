"""LoRA adapters on the server (nanoqwen/entrypoints/server/lora.py): the request's `model` picks the base model or
an adapter; /v1/models lists them with their parent; adapters load and unload at run time behind the API key; an
unknown adapter is a 404 in OpenAI's error shape; /metrics carries vLLM's lora_requests_info gauge."""

from __future__ import annotations

import sys
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient

from nanoqwen import LLM, LoRARequest, SamplingParams
from nanoqwen.config.engine import EngineConfig
from nanoqwen.engine.llm_engine import LLMEngine
from nanoqwen.entrypoints.server import build_app

sys.path.insert(0, str(Path(__file__).parents[2] / "lora"))
from lora_testing import ALL_SEVEN, write_peft_adapter  # noqa: E402

pytest.importorskip("peft")
PROMPT = [9707, 11, 847, 829, 374, 1207, 16948, 13]
OPTIONS = dict(dtype="float32", device="cpu", max_model_len=64, kv_cache_memory=8 << 20, block_size=4,
               enforce_eager=True)


@pytest.fixture(scope="module")
def setup(checkpoint, tmp_path_factory):
    base = checkpoint("tiny", dtype="float32")
    root = tmp_path_factory.mktemp("server-adapters")
    a1 = write_peft_adapter(base, root / "a1", 1, r=4, lora_alpha=8, target_modules=ALL_SEVEN)
    a2 = write_peft_adapter(base, root / "a2", 2, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    # what each gives offline, greedy
    llm = LLM(base, enable_lora=True, max_loras=2, **OPTIONS)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = {name: llm.generate([PROMPT], params, use_tqdm=False, lora_request=req)[0].outputs[0].text
                for name, req in [("base", None), ("a1", LoRARequest("a1", 1, str(a1))),
                                  ("a2", LoRARequest("a2", 2, str(a2)))]}
    assert len(set(expected.values())) == 3
    return base, a1, a2, expected


@pytest.fixture
def served(setup):
    base, a1, _, _ = setup
    engine = LLMEngine(EngineConfig(base, enable_lora=True, max_loras=2, **OPTIONS))
    engine.add_lora(LoRARequest("a1", 1, str(a1)))  # as --lora-modules a1=PATH does
    with TestClient(build_app(engine, "base", api_key="sesame")) as http:
        http.headers["authorization"] = "Bearer sesame"
        yield http, openai.OpenAI(base_url="http://testserver/v1", api_key="sesame", http_client=http,
                                  max_retries=0)


def complete(client: openai.OpenAI, model: str) -> str:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text


def test_two_adapters_and_the_base_load_use_unload_404(setup, served):
    _, _, a2, expected = setup
    http, client = served
    assert complete(client, "base") == expected["base"]
    assert complete(client, "a1") == expected["a1"]
    assert client.completions.create(model="base", prompt=PROMPT, max_tokens=1).model == "base"
    with pytest.raises(openai.NotFoundError) as e:
        complete(client, "a2")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(a2)})
    assert r.status_code == 200 and "a2" in r.text
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"base", "a1", "a2"}
    assert models["a1"].parent == "base" and models["a2"].parent == "base"
    assert complete(client, "a2") == expected["a2"]
    chat = client.chat.completions.create(model="a2", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.model == "a2"  # (as vLLM: the adapter's name)
    streamed = client.completions.create(model="a2", prompt=PROMPT, max_tokens=2, stream=True)
    assert {chunk.model for chunk in streamed} == {"a2"}
    info = [line for line in http.get("/metrics").text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="2"' in info[0]
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})
    assert r.status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete(client, "a2")
    assert {m.id for m in client.models.list().data} == {"base", "a1"}
    assert complete(client, "a1") == expected["a1"]


def test_load_and_unload_errors(setup, served):
    _, _, a2, _ = setup
    http, _ = served
    for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):  # behind the API key
        r = http.post(route, json={"lora_name": "x", "lora_path": str(a2)}, headers={"authorization": "Bearer no"})
        assert r.status_code == 401
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": str(a2)})
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/no/such/folder"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "x"}).status_code == 400


def test_a_server_without_lora_refuses_adapters(setup):
    base, a1, _, _ = setup
    with TestClient(build_app(LLMEngine(EngineConfig(base, **OPTIONS)), "base")) as http:
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": str(a1)})
        assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]
        r = http.post("/v1/completions", json={"model": "a1", "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 404
        assert "vllm:lora_requests_info" not in http.get("/metrics").text


def test_responses_and_messages_pick_the_adapter_by_model(served):
    """/v1/responses and /v1/messages run the adapter their `model` names, and answer with its name."""
    http, client = served
    messages = [{"role": "user", "content": "hi"}]
    texts = {}
    for model in ("base", "a1"):
        chat = client.chat.completions.create(model=model, messages=messages, max_tokens=5, temperature=0,
                                              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        response = client.responses.create(model=model, input="hi", max_output_tokens=5, temperature=0,
                                           reasoning={"effort": "none"})
        message = http.post("/v1/messages", json={"model": model, "max_tokens": 5, "messages": messages,
                                                  "thinking": {"type": "disabled"}, "temperature": 0}).json()
        assert response.model == message["model"] == model
        text = "".join(b["text"] for b in message["content"] if b["type"] == "text")
        assert response.output_text.strip() == text.strip() == (chat.choices[0].message.content or "").strip()
        texts[model] = text
    assert texts["base"] != texts["a1"]
