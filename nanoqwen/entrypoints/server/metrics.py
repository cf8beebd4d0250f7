"""Prometheus metrics of one server, in a CollectorRegistry of its own (so several apps can live in
one process, e.g. in tests, without clashing in the global registry)."""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
# the paths counted by name (any other is "other", so unknown paths cannot grow the label set)
ENDPOINTS = {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/rerank", "/rerank",
             "/v2/rerank", "/score", "/v1/score", "/v1/models", "/health", "/metrics"}


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.http_requests = Counter("nanoqwen_http_requests",
                                     "HTTP requests by endpoint and status code",
                                     ["endpoint", "status"], registry=r)
        self.finished = Counter("nanoqwen_requests_finished",
                                "Requests by how they ended (stop, length, tool_calls, "
                                "abort: client gone, error); embedding and scoring ones end in "
                                "stop",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("nanoqwen_prompt_tokens",
                                     "Prompt tokens of generation, embedding and scoring requests",
                                     registry=r)
        self.generation_tokens = Counter("nanoqwen_generation_tokens", "Generated tokens",
                                         registry=r)
        self.ttft = Histogram("nanoqwen_time_to_first_token_seconds",
                              "From the request's arrival to its first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("nanoqwen_time_per_output_token_seconds",
                              "Mean time between tokens after the first, per request",
                              buckets=TPOT_BUCKETS, registry=r)
        self.running = Gauge("nanoqwen_num_requests_running", "Requests that are generating",
                             registry=r)
        self.waiting = Gauge("nanoqwen_num_requests_waiting", "Requests accepted with no token yet",
                             registry=r)
        self.engine_running = Gauge("nanoqwen_engine_sequences_running",
                                    "Sequences the scheduler runs", registry=r)
        self.engine_waiting = Gauge("nanoqwen_engine_sequences_waiting",
                                    "Sequences the scheduler has queued", registry=r)
        self.kv_usage = Gauge("nanoqwen_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use",
                              registry=r)
        self.kv_used = Gauge("nanoqwen_kv_cache_used_blocks", "KV-cache blocks in use", registry=r)
        self.kv_blocks = Gauge("nanoqwen_kv_cache_blocks", "KV-cache blocks in all", registry=r)
        self.prefix_hit_rate = Gauge("nanoqwen_prefix_cache_hit_rate",
                                     "Fraction of prefix-cache lookups that hit", registry=r)
        self.preemptions = Gauge("nanoqwen_num_preemptions",
                                 "Sequences preempted so far (KV cache full)", registry=r)
        # speculative decoding, as vLLM's spec_decode counters (0 without a speculative_config)
        self.spec_drafts = Gauge("nanoqwen_spec_decode_num_drafts",
                                 "Verification steps of speculative decoding so far", registry=r)
        self.spec_draft_tokens = Gauge("nanoqwen_spec_decode_num_draft_tokens",
                                       "Draft tokens proposed so far", registry=r)
        self.spec_accepted_tokens = Gauge("nanoqwen_spec_decode_num_accepted_tokens",
                                          "Draft tokens accepted so far", registry=r)
        self.spec_pauses = Gauge("nanoqwen_spec_decode_num_pauses",
                                 "Times a sequence's drafts were paused for not paying",
                                 registry=r)

    def count_http(self, path: str, status: int) -> None:
        self.http_requests.labels(path if path in ENDPOINTS else "other", str(status)).inc()

    def record_request(self, prompt_tokens: int, generated: int, finish_reason: str,
                       ttft: float | None, tpot: float | None) -> None:
        """One request ended (an embedding or scoring request: its inputs' tokens, nothing
        generated, no token timings)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated)
        self.finished.labels(finish_reason).inc()
        if ttft is not None:
            self.ttft.observe(ttft)
        if tpot is not None:
            self.tpot.observe(tpot)

    def render(self, running: int, waiting: int, stats: dict[str, Any]) -> bytes:
        """The exposition text, with the gauges set from the current state first."""
        self.running.set(running)
        self.waiting.set(waiting)
        for gauge, key in ((self.engine_running, "num_running"),
                           (self.engine_waiting, "num_waiting"),
                           (self.kv_usage, "usage"), (self.kv_used, "used_blocks"),
                           (self.kv_blocks, "num_blocks"),
                           (self.prefix_hit_rate, "prefix_cache_hit_rate"),
                           (self.preemptions, "num_preemptions"),
                           (self.spec_drafts, "spec_decode_num_drafts"),
                           (self.spec_draft_tokens, "spec_decode_num_draft_tokens"),
                           (self.spec_accepted_tokens, "spec_decode_num_accepted_tokens"),
                           (self.spec_pauses, "spec_decode_num_pauses")):
            if key in stats:
                gauge.set(stats[key])
        return generate_latest(self.registry)
