"""Prometheus metrics of one server, in a CollectorRegistry of its own (so several apps can live in
one process, e.g. in tests, without clashing in the global registry).

Two name sets describe the same server: nanoqwen's own (`nanoqwen_*`) and vLLM's (`vllm:*`, with vLLM's types and
its `model_name` and `engine` labels), so routers that balance vLLM replicas (vLLM's production-stack router, llm-d's
endpoint picker) and dashboards made for vLLM read a nanoqwen server unchanged. docs/serving.md lists both.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
# the paths counted by name (any other is "other", so unknown paths cannot grow the label set)
ENDPOINTS = {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/rerank", "/rerank",
             "/v2/rerank", "/score", "/v1/score", "/v1/models", "/health", "/metrics", "/v1/responses",
             "/v1/messages", "/v1/messages/count_tokens", "/tokenize", "/detokenize", "/version"}
# vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards' quantiles line up
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                     40.0, 80.0)
VLLM_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                        240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM's finished_reason values; nanoqwen's tool_calls ends in "stop", a client that left in "abort"
VLLM_FINISH_REASONS = {"stop": "stop", "tool_calls": "stop", "length": "length", "abort": "abort",
                       "error": "error"}


def one_two_five_buckets(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to limit: vLLM's buckets for token counts."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(buckets)
            buckets.append(float(m * scale))
        scale *= 10


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str = "", max_model_len: int = 40960) -> None:
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
        self.vllm = VllmMetrics(r, model_name, max_model_len)

    def count_http(self, path: str, status: int) -> None:
        self.http_requests.labels(path if path in ENDPOINTS else "other", str(status)).inc()

    def record_request(self, prompt_tokens: int, generated: int, finish_reason: str,
                       ttft: float | None, tpot: float | None, e2e: float | None = None,
                       token_gaps: Iterable[float] = ()) -> None:
        """One request ended (an embedding or scoring request: its inputs' tokens, nothing
        generated, no token timings). e2e: from its arrival to its end; token_gaps: the time before each
        token after the first, as the server saw them arrive."""
        self.vllm.record_request(prompt_tokens, generated, finish_reason, ttft, tpot, e2e, token_gaps)
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
        self.vllm.engine_stats = stats
        return generate_latest(self.registry)


class VllmMetrics(Collector):
    """vLLM's metric names and types, over the same numbers: request histograms and counters are
    recorded here as requests end; the scheduler's and the KV cache's numbers are read from the engine's
    stats at each scrape (collect())."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        self.labels = {"model_name": model_name, "engine": "0"}
        self.engine_stats: dict[str, Any] = {}
        names = list(self.labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=registry).labels(**self.labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=registry).labels(**self.labels)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.request_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                       [*names, "finished_reason"], registry=registry)
        token_buckets = one_two_five_buckets(max_model_len)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", token_buckets)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              VLLM_TTFT_BUCKETS)
        self.inter_token_latency = histogram("vllm:inter_token_latency_seconds",
                                             "Histogram of inter-token latency in seconds.", VLLM_TPOT_BUCKETS)
        # vLLM's older name of the same histogram, which it still exports beside the new one
        self.time_per_output_token = histogram("vllm:time_per_output_token_seconds",
                                               "Histogram of time per output token in seconds.", VLLM_TPOT_BUCKETS)
        self.request_tpot = histogram("vllm:request_time_per_output_token_seconds",
                                      "Histogram of time_per_output_token_seconds per request.", VLLM_TPOT_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             VLLM_LATENCY_BUCKETS)
        registry.register(self)

    def record_request(self, prompt_tokens: int, generated: int, finish_reason: str, ttft: float | None,
                       tpot: float | None, e2e: float | None, token_gaps: Iterable[float]) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated)
        self.request_success.labels(**self.labels,
                                    finished_reason=VLLM_FINISH_REASONS.get(finish_reason, "stop")).inc()
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generated)
        if ttft is not None:
            self.ttft.observe(ttft)
        if tpot is not None:
            self.request_tpot.observe(tpot)
        for gap in token_gaps:
            self.inter_token_latency.observe(gap)
            self.time_per_output_token.observe(gap)
        if e2e is not None:
            self.e2e.observe(e2e)

    def describe(self) -> Iterator[Metric]:
        return iter(())  # collected at scrape time; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        """The scheduler's and the KV cache's numbers, from the engine's stats at this scrape."""
        stats, names, values = self.engine_stats, list(self.labels), list(self.labels.values())

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            return family

        block_size = stats.get("block_size", 1)
        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    stats.get("num_running", 0))
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    stats.get("num_waiting", 0))
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", stats.get("usage", 0.0))
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      stats.get("prefix_cache_queries", 0) * block_size)
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      stats.get("prefix_cache_hits", 0) * block_size)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      stats.get("num_preemptions", 0))
        if "max_lora" in stats:  # LoRA adapters (docs/lora.md): vLLM's info gauge, its value the scrape's time
            lora = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                     labels=["running_lora_adapters", "max_lora", "waiting_lora_adapters"])
            lora.add_metric([str(stats["lora_running_adapters"]), str(stats["max_lora"]),
                             str(stats["lora_waiting_adapters"])], time.time())
            yield lora
