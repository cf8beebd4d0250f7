"""DRY's request fields (dry_multiplier, dry_base, dry_allowed_length, dry_penalty_last_n, dry_sequence_breakers)
on completions and chat completions, through an in-process server on a random tiny checkpoint."""

from __future__ import annotations

import httpx
import pytest
from server_testing import serve_app

from nanoqwen import LLM, SamplingParams
from nanoqwen.config.engine import EngineConfig
from nanoqwen.engine.llm_engine import LLMEngine
from nanoqwen.entrypoints.server import build_app

pytestmark = pytest.mark.timeout(180)
PROMPT = "The cat sat on the mat."
OPTIONS = {"dtype": "float32", "device": "cpu", "max_model_len": 128, "kv_cache_memory": 16 << 20}
DRY = {"dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": -1,
       "dry_sequence_breakers": ["\n", ":"]}


@pytest.fixture(scope="module")
def model_dir(checkpoint):
    return checkpoint("tiny", std=0.08)


@pytest.fixture(scope="module")
def base(model_dir):
    engine = LLMEngine(EngineConfig(str(model_dir), **OPTIONS))
    with serve_app(build_app(engine, "tiny")) as url:
        yield url


def test_dry_fields_reach_the_sampler(base, model_dir):
    llm = LLM(model_dir, **OPTIONS)
    plain = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                         use_tqdm=False)[0].text
    expected = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, **DRY),
                            use_tqdm=False)[0].text
    assert expected != plain  # (this random model loops: DRY changes its answer)
    r = httpx.post(f"{base}/v1/completions", timeout=60, json={
        "prompt": PROMPT, "max_tokens": 30, "temperature": 0, "ignore_eos": True, **DRY})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected
    r = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "dry_multiplier": 1.5})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("field", "value"), [
    ("dry_multiplier", -1), ("dry_multiplier", "0.8"), ("dry_base", 0.5), ("dry_allowed_length", 0),
    ("dry_allowed_length", 2.5), ("dry_penalty_last_n", -5), ("dry_sequence_breakers", "\n"),
    ("dry_sequence_breakers", [""]), ("dry_sequence_breakers", [3]),
])
def test_bad_dry_values_are_400_naming_the_field(base, field, value):
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = httpx.post(f"{base}{path}", timeout=60, json={**body, "max_tokens": 2, field: value})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert field in error["message"] and error["param"] == field, error
