"""Prometheus metrics of one server (its own registry, so several servers can live in one process).

Names follow vLLM's where they mean the same thing (``decodekit:`` prefix for ``vllm:``), so
existing dashboards need only the prefix changed."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .scheduler import Scheduler

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _BatcherCollector:
    """Batched passes and the rows they carried, read from the batcher at scrape time."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    def collect(self):
        batcher = self.scheduler.batcher
        yield CounterMetricFamily("decodekit:batched_passes", "Forward passes run for the batch", value=batcher.passes)
        yield CounterMetricFamily("decodekit:batched_rows", "Token rows those passes carried", value=batcher.rows)
        yield CounterMetricFamily("decodekit:prefix_cache_hit_tokens",
                                  "Prompt tokens taken from a slot's cache or the prompt cache", value=self.scheduler.prefix_tokens)
        cache = self.scheduler.prompt_cache
        yield GaugeMetricFamily("decodekit:prompt_cache_bytes", "Bytes the prompt cache holds",
                                value=0 if cache is None else cache.nbytes)
        yield GaugeMetricFamily("decodekit:prompt_cache_entries", "Prompts the prompt cache holds",
                                value=0 if cache is None else len(cache))


class ServerMetrics:
    def __init__(self, scheduler: Scheduler):
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("decodekit:num_requests_running", "Requests decoding now", registry=r,
                             ).set_function(lambda: scheduler.running)
        self.waiting = Gauge("decodekit:num_requests_waiting", "Requests waiting for a slot", registry=r,
                             ).set_function(lambda: scheduler.waiting)
        # each choice of a request with n > 1 is counted as a request of its own (as vLLM does)
        self.prompt_tokens = Counter("decodekit:prompt_tokens", "Prompt tokens, once per choice", registry=r)
        self.generation_tokens = Counter("decodekit:generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter("decodekit:request_success", "Finished choices by finish reason (cancelled: the client left)", ["finished_reason"], registry=r)
        self.errors = Counter("decodekit:request_errors", "Requests answered with an error, by HTTP status", ["status"], registry=r)
        self.ttft = Histogram("decodekit:time_to_first_token_seconds", "Time to first token", registry=r, buckets=LATENCY_BUCKETS)
        self.itl = Histogram("decodekit:time_per_output_token_seconds", "Mean time per output token after the first, per request",
                             registry=r, buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("decodekit:e2e_request_latency_seconds", "Request latency, queueing included", registry=r,
                             buckets=LATENCY_BUCKETS)
        self.queued = Histogram("decodekit:request_queue_time_seconds", "Time waiting for a slot", registry=r, buckets=LATENCY_BUCKETS)
        self.spec_drafted = Counter("decodekit:spec_decode_num_draft_tokens", "Draft tokens verified", registry=r)
        self.spec_accepted = Counter("decodekit:spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=r)
        r.register(_BatcherCollector(scheduler))

    def finished(self, *, prompt_tokens: int, generation, queued_s: float, ttft_s: float | None, e2e_s: float) -> None:
        """Record one finished choice."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generation.generated)
        self.requests.labels(generation.finish_reason).inc()
        self.queued.observe(queued_s)
        self.e2e.observe(e2e_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            if generation.generated > 1:  # (tokens a stop string cut off were decoded in that time too)
                self.itl.observe((e2e_s - ttft_s) / (generation.generated - 1))
        extra = generation.stats.extra
        if "drafted" in extra:
            self.spec_drafted.inc(extra["drafted"])
            self.spec_accepted.inc(extra["accepted"])

    def text(self) -> bytes:
        return generate_latest(self.registry)
