"""What the server tests share: /metrics read as numbers, an app served by uvicorn in a thread, a real
`nanoqwen serve` process, and ScriptedEngine (LLMEngine's interface with scripted answers, for what a random
model cannot show)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
import uvicorn
from fastapi import FastAPI

from nanoqwen import SamplingParams
from nanoqwen.distributed import free_port
from nanoqwen.errors import InvalidRequestError
from nanoqwen.outputs import CompletionOutput, RequestOutput
from nanoqwen.tokenizer import Tokenizer


def metrics(base: str) -> dict[str, float]:
    """/metrics as {'name{labels}': value}."""
    text = httpx.get(f"{base}/metrics").text
    return {name: float(value) for name, value in re.findall(r"^([^#\s]\S*) (\S+)$", text, re.M)}


def wait_idle(base: str, timeout: float = 5.0) -> dict[str, float]:
    """Poll /metrics until no request runs or waits and every KV block is free."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(base)
        keys = ("nanoqwen_num_requests_running", "nanoqwen_num_requests_waiting",
                "nanoqwen_kv_cache_used_blocks", "nanoqwen_engine_sequences_running",
                "nanoqwen_engine_sequences_waiting")
        if all(m[k] == 0 for k in keys) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


@contextmanager
def serve_app(app: FastAPI, timeout: float = 60) -> Iterator[str]:
    """`app` served by uvicorn in a thread on a free port, for the block: its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextmanager
def nanoqwen_serve(model_dir: Path, log: Path, *args: str) -> Iterator[SimpleNamespace]:
    """`nanoqwen serve --model model_dir ARGS` on a free port, its output in `log`, killed at the end
    (unless a test stopped it): (base URL, process, log)."""
    port = free_port()
    cmd = [sys.executable, "-m", "nanoqwen", "serve", "--model", str(model_dir),
           "--port", str(port), *args]
    # as an in-process LLM of the same test: same float sums
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"server did not start:\n{log.read_text()}")
        time.sleep(0.1)
    try:
        yield SimpleNamespace(base=base, proc=proc, log=log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class ScriptedEngine:
    """LLMEngine's interface with scripted answers: script(prompt text) is the answer, emitted
    `chunk` characters per step (so tags split across stream deltas), one placeholder token id
    per step."""

    def __init__(self, tokenizer: Tokenizer, script, chunk: int = 3, max_model_len: int = 4096,
                 step_seconds: float = 0.003) -> None:
        self.tokenizer, self.script = tokenizer, script
        self.chunk, self.max_model_len = chunk, max_model_len
        # like a real step: lets the handler see (nearly) every delta
        self.step_seconds = step_seconds
        self.requests: dict[str, list] = {}
        self.prompts: list[str] = []
        self.params: list[SamplingParams] = []  # each request's, as the server made them
        # what /props reads
        self.model_dir = Path("scripted")
        self.engine_config = SimpleNamespace(max_num_seqs=4)
        self.gate = threading.Event()
        self.gate.set()

    @property
    def input_processor(self) -> ScriptedEngine:  # (the engine's input checks are its own here)
        return self

    def default_sampling_params(self) -> SamplingParams:
        return SamplingParams(temperature=0.6, top_k=20, top_p=0.95)

    def validate_prompt(self, ids: list[int]) -> None:
        if not ids or len(ids) >= self.max_model_len:
            raise InvalidRequestError(f"the prompt has {len(ids)} tokens "
                                      f"but max_model_len is {self.max_model_len}")

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate_prompt(ids)
        return ids

    def add_request(self, request_id, prompt, params, prompt_token_ids=None) -> None:
        text = self.tokenizer.decode(prompt_token_ids)
        self.prompts.append(text)
        self.params.append(params)
        self.requests[request_id] = [prompt_token_ids, params, self.script(text), 0]

    def step(self) -> list[RequestOutput]:
        self.gate.wait()
        time.sleep(self.step_seconds)
        outputs = []
        for request_id, state in list(self.requests.items()):
            ids, params, answer, pos = state
            if answer == "FAIL":
                raise RuntimeError("scripted failure")
            pos = state[3] = min(len(answer), pos + self.chunk)
            n = -(-pos // self.chunk)
            done = pos >= len(answer)
            reason = ("stop" if done
                      else "length" if params.max_tokens is not None and n >= params.max_tokens
                      else None)
            outs = [CompletionOutput(i, answer[:pos], [1] * n, reason) for i in range(params.n)]
            outputs.append(RequestOutput(request_id, None, ids, outs, reason is not None))
            if reason is not None:
                del self.requests[request_id]
        return outputs

    def abort_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def kv_cache_stats(self) -> dict[str, float]:
        return {"num_blocks": 8, "used_blocks": len(self.requests),
                "usage": len(self.requests) / 8, "num_running": len(self.requests),
                "num_waiting": 0}
