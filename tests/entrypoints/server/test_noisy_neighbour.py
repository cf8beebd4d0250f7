"""No request can hurt another, through the server: 20 streaming requests and one hostile request sent
together; the 20 finish with exactly the text they get alone, the hostile one gets its own 400 (or its own
error), and nothing is left in the engine. The server runs in-process under uvicorn on a tiny random
checkpoint."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
from server_testing import serve_app

from nanoqwen import LLM
from nanoqwen.entrypoints.server import build_app
from nanoqwen.worker import model_runner

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
NEIGHBOURS = 20
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def served(checkpoint):
    engine = LLM(checkpoint("tiny", dtype="float32"), dtype="float32", device="cpu", max_model_len=512,
                 kv_cache_memory=64 << 20, seed=0, enforce_eager=True, num_scheduler_steps=4).llm_engine
    with serve_app(build_app(engine, "tiny")) as base:
        yield SimpleNamespace(engine=engine, base=base)


def neighbour_body(i: int) -> dict:
    return {"model": "tiny", "prompt": f"Neighbour {i} says", "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}


def stream_text(base: str, body: dict) -> str:
    """The text of a streamed completion, or the error event's message."""
    text = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                return "ERROR: " + event["error"]["message"]
            text.append(event["choices"][0]["text"])
    return "".join(text)


@pytest.fixture(scope="module")
def alone(served) -> list[str]:
    """Each neighbour's text when it runs alone."""
    return [stream_text(served.base, neighbour_body(i)) for i in range(NEIGHBOURS)]


def raw_post(base: str, body: str) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", content=body, headers={"Content-Type": "application/json"},
                      timeout=120)


PROMPT = '"model": "tiny", "prompt": "Hostile", "max_tokens": 40'
# the hostile request: (case id, JSON body text, the HTTP status, the error's param, words of its message)
HOSTILE = [
    ("int64-overflowing-stop-id", f'{{{PROMPT}, "stop_token_ids": [9223372036854775808]}}', 400, "stop_token_ids",
     "is not a token id of this model"),
    ("stop-id-past-the-vocabulary", f'{{{PROMPT}, "stop_token_ids": [151936]}}', 400, "stop_token_ids",
     "ids are in [0, 151936)"),
    ("infinite-temperature", f'{{{PROMPT}, "temperature": Infinity}}', 400, "temperature", ""),
    ("nan-top-p", f'{{{PROMPT}, "top_p": NaN}}', 400, "top_p", ""),
    ("ten-million-answers", f'{{{PROMPT}, "n": 10000000}}', 400, "n", ""),
    ("too-many-stop-ids", f'{{{PROMPT}, "stop_token_ids": {list(range(2000))}}}', 400, "stop_token_ids",
     "more than this engine's limit of 1024"),
    ("too-many-stop-strings", f'{{{PROMPT}, "stop": {json.dumps([str(i) for i in range(100)])}}}', 400, "stop",
     "more than this engine's limit of 64"),
    ("prompt-ids-past-the-vocabulary", '{"model": "tiny", "prompt": [1, 9223372036854775808], "max_tokens": 4}',
     400, "prompt", "is not in the vocabulary"),
]


@pytest.mark.parametrize("case, body, status, param, words", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_a_hostile_request_gets_its_own_error_and_the_others_their_tokens(served, alone, case, body, status,
                                                                          param, words):
    with ThreadPoolExecutor(NEIGHBOURS + 1) as pool:
        neighbours = [pool.submit(stream_text, served.base, neighbour_body(i)) for i in range(NEIGHBOURS)]
        hostile = pool.submit(raw_post, served.base, body)
        texts = [f.result() for f in neighbours]
        r = hostile.result()
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert texts == alone
    assert_idle(served.engine)


def test_a_request_that_breaks_a_step_fails_alone(served, alone, monkeypatch):
    """A request no check stops (a bug) that makes the sampler raise: its stream ends with an error event of
    its own; every neighbour finishes with its text."""
    sample = model_runner.sample

    def sample_or_fail(logits, params, *args, **kwargs):
        if any(p.seed == 999 for p in params):
            raise RuntimeError("Overflow when unpacking long long")
        return sample(logits, params, *args, **kwargs)

    monkeypatch.setattr(model_runner, "sample", sample_or_fail)
    hostile = {"model": "tiny", "prompt": "Hostile", "max_tokens": 40, "seed": 999, "temperature": 1.0,
               "stream": True}
    with ThreadPoolExecutor(NEIGHBOURS + 1) as pool:
        neighbours = [pool.submit(stream_text, served.base, neighbour_body(i)) for i in range(NEIGHBOURS)]
        bad = pool.submit(stream_text, served.base, hostile)
        texts = [f.result() for f in neighbours]
    assert bad.result() == ("ERROR: the engine failed on this request: RuntimeError: Overflow when unpacking "
                            "long long")
    assert texts == alone
    whole = httpx.post(f"{served.base}/v1/completions", json={**hostile, "stream": False}, timeout=120)
    assert whole.status_code == 500 and whole.json()["error"]["code"] == "request_failed"
    assert_idle(served.engine)


def assert_idle(engine) -> None:
    deadline = time.monotonic() + 30  # (the engine thread may still be freeing the last request's blocks)
    while engine.requests and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.requests and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
