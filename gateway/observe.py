"""What the gateway tells about itself: Prometheus metrics and one trace per request.

**Span model.** Each request is one trace (under the client's own `traceparent` when it sent one):

    shardmesh.v1.Gateway/Generate        the RPC, arrival to last message (SERVER)
    ├── queue                            submitted until it got a KV slot
    ├── step.prefill                     one per prompt chunk
    │   ├── worker.step  (stage 0, tp 0)  one per shard: compute, recv wait, send, bytes in/out
    │   └── ...
    ├── step.decode                      one per decode step, for the first `trace_decode_steps`
    │   └── worker.step ...
    └── (later decode steps: counted on the request span, `shardmesh.decode.*`)

With pipelining, up to pp steps (micro-batches) are in flight at once, each with its own step spans:
`shardmesh.step.in_flight` (steps in flight once it was sent) and `shardmesh.step.after_step_id`
(the step the workers run just before it) place it in the schedule, and its `worker.step` spans
show the overlap (stage 0 running step n + 1 while stage 1 runs step n) and how long each waited
for its turn (`shardmesh.step.order_wait_ms`).

A batched step serves several requests, so it has one `step.*` span in each traced request's trace
(all with the same `shardmesh.step_id` and the batch's `shardmesh.batch.request_ids`), and every
worker records its `worker.step` span once under each of them (the Step RPC carries every parent,
see shardmesh/rpc/telemetry.py). Volume per request is bounded: prompt chunks + `trace_decode_steps`
steps, each with pp × tp worker spans; past that, decode steps are only aggregated on the request
span (count, gateway round-trip time, the last stage's compute and receive-wait time).

**GenAI conventions.** Beside our `shardmesh.*` attributes the request span carries OpenTelemetry's GenAI
semantic-convention attributes, so generic LLM dashboards read it: `gen_ai.operation.name` ("chat" for a
conversation, "text_completion" for a prompt or token ids), `gen_ai.request.model` (the name the model is
served under), `gen_ai.request.max_tokens` / `temperature` / `top_p` (and `top_k`, `seed`, `frequency_penalty`,
`presence_penalty`, `stop_sequences` when set), and once it ends `gen_ai.response.finish_reasons` (OpenAI's names:
"stop" or "length"; `shardmesh.finish_reason` tells "eos", "stop_string" and "stop_token" apart) and
`gen_ai.usage.input_tokens` / `output_tokens`; a failed one `error.type` (its status code).

All of it runs only when tracing is on (`tracer is not None`); metrics only when `--metrics-port` is
set. With both off the scheduler holds no observer at all.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.blocks import PoolStats
from gateway.service_name import SERVICE_NAME
from shardmesh.rpc import telemetry

if TYPE_CHECKING:
    from gateway.fanout import MeshView
    from gateway.requests import PreparedRequest
    from gateway.results import Summary
    from gateway.watcher import MeshState
    from shardmesh.proto.v1 import worker_pb2

DEFAULT_TRACE_DECODE_STEPS = 8
MAX_BATCH_IDS = 64  # request ids listed on a step span
# gen_ai.operation.name by prompt form (`PromptInput.kind`): a conversation is a chat, the rest text completions.
GENAI_OPERATIONS = {"chat": "chat", "prompt": "text_completion", "token_ids": "text_completion"}


def genai_request(input_kind: str, req: PreparedRequest, model: str) -> dict[str, Any]:
    """The GenAI semantic-convention attributes of a request as it will run (`max_tokens` is the budget it got,
    the default length included). `input_kind` is the prompt's form (`PromptInput.kind`), `model` the name the
    gateway serves the model under ("" when unknown: left out)."""
    s = req.sampling
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": GENAI_OPERATIONS.get(input_kind, "text_completion"),
        "gen_ai.request.max_tokens": req.max_new_tokens, "gen_ai.request.temperature": s.temperature,
        "gen_ai.request.top_p": s.top_p,
    }  # fmt: skip
    if model:
        attributes["gen_ai.request.model"] = model
    if s.top_k:
        attributes["gen_ai.request.top_k"] = s.top_k
    if s.seed is not None:
        attributes["gen_ai.request.seed"] = s.seed
    if s.frequency_penalty:
        attributes["gen_ai.request.frequency_penalty"] = s.frequency_penalty
    if s.presence_penalty:
        attributes["gen_ai.request.presence_penalty"] = s.presence_penalty
    if req.stop:
        attributes["gen_ai.request.stop_sequences"] = list(req.stop)
    return attributes


def served_model(state: MeshState) -> str:
    """The model's name for clients in a mesh state (the coordinator's `--model` as given), "" before any."""
    return state.topology.model.name if state.topology is not None else ""


class RequestTrace:
    """One request's spans. The RPC thread creates it and ends the request span; in between the
    scheduler thread owns it (queue, steps, summary)."""

    def __init__(self, tracer: Any, span: Any) -> None:
        self.tracer = tracer
        self.span = span
        self.trace_id = telemetry.span_trace_id(span)
        self._queue: Any = None
        self.prefill_steps = 0
        self.decode_steps = 0
        self.untraced_steps = 0
        self.untraced_s = 0.0
        self.untraced_compute_ms = 0.0
        self.untraced_recv_wait_ms = 0.0

    @property
    def recording(self) -> bool:
        return self.span.is_recording()

    def child(self, name: str, **kw: Any) -> Any:
        from opentelemetry import trace

        return self.tracer.start_span(name, context=trace.set_span_in_context(self.span), **kw)

    def queued(self) -> None:
        if self.recording:
            self._queue = self.child("queue")

    def resumed(self, reason: str, replay_tokens: int, waited_s: float) -> None:
        """An event on the request span: its workers were lost, and it replays its log on a new mesh."""
        if self.recording:
            self.span.add_event("resumed", {"shardmesh.reason": reason, "shardmesh.replay_tokens": replay_tokens,
                                            "shardmesh.waited_ms": round(waited_s * 1000, 3)})  # fmt: skip

    def admitted(self, slot: int) -> None:
        if self._queue is not None:
            self._queue.set_attribute("shardmesh.slot", slot)
            self._queue.end()
            self._queue = None

    def prepared(self, start_ns: int, prompt_tokens: int) -> None:
        """Validation, chat template and tokenization, from `start_ns` until now."""
        if self.recording:
            span = self.child("prepare", start_time=start_ns, attributes={"shardmesh.prompt_tokens": prompt_tokens})
            span.end()

    def requested(self, input_kind: str, req: PreparedRequest, model: str) -> None:
        """What was asked, in the GenAI conventions (`genai_request`); called once it is prepared."""
        if self.recording:
            self.span.set_attributes(genai_request(input_kind, req, model))

    def first_token(self) -> None:
        if self.recording:
            self.span.add_event("first_token")

    def finished(self, summary: Summary, traced_decode_limit: int) -> None:
        self.admitted(-1)  # ended before it got a slot (cancelled): the queue span ends here
        if not self.recording:  # the RPC already ended it (a stream the client closed)
            return
        t = summary.timings
        self.span.set_attributes({
            "shardmesh.finish_reason": summary.finish_reason.value, "shardmesh.prompt_tokens": summary.prompt_tokens,
            "shardmesh.completion_tokens": summary.completion_tokens, "shardmesh.queue_ms": t.queue_ms,
            "shardmesh.time_to_first_token_ms": t.time_to_first_token_ms, "shardmesh.total_ms": t.total_ms,
            "shardmesh.mean_inter_token_ms": t.mean_inter_token_ms,
            "gen_ai.response.finish_reasons": [summary.finish_reason.openai],
            "gen_ai.usage.input_tokens": summary.prompt_tokens, "gen_ai.usage.output_tokens": summary.completion_tokens,
        })  # fmt: skip
        self._steps(traced_decode_limit)

    def failed(self, error: Exception, traced_decode_limit: int) -> None:
        from opentelemetry.trace import Status, StatusCode

        self.admitted(-1)
        if self.recording:
            self.span.set_status(Status(StatusCode.ERROR, str(error)))
            self._steps(traced_decode_limit)

    def _steps(self, limit: int) -> None:
        self.span.set_attributes({
            "shardmesh.prefill.steps": self.prefill_steps, "shardmesh.decode.steps": self.decode_steps,
            "shardmesh.decode.traced_steps": min(self.decode_steps, limit),
            "shardmesh.decode.untraced_steps": self.untraced_steps,
            "shardmesh.decode.untraced_ms": self.untraced_s * 1e3,
            "shardmesh.decode.untraced_last_stage_compute_ms": self.untraced_compute_ms,
            "shardmesh.decode.untraced_last_stage_recv_wait_ms": self.untraced_recv_wait_ms,
        })  # fmt: skip


@dataclass
class StepTrace:
    """The spans of one step: `spans[i]` belongs to `traces[i]`; `untraced` only get aggregated."""

    spans: list[Any]
    untraced: list[RequestTrace]
    metadata: list[tuple[str, str]] | None
    started: float

    def end(self, response: worker_pb2.StepResponse | None, error: str = "") -> None:
        for span in self.spans:
            if error:
                from opentelemetry.trace import Status, StatusCode

                span.set_status(Status(StatusCode.ERROR, error))
            elif response is not None:
                span.set_attributes({"shardmesh.last_stage.compute_ms": response.compute_ms,
                                     "shardmesh.last_stage.recv_wait_ms": response.recv_wait_ms,
                                     "shardmesh.last_stage.order_wait_ms": response.order_wait_ms})  # fmt: skip
            span.end()
        if self.untraced and response is not None:
            elapsed = time.monotonic() - self.started
            for t in self.untraced:
                t.untraced_steps += 1
                t.untraced_s += elapsed
                t.untraced_compute_ms += response.compute_ms
                t.untraced_recv_wait_ms += response.recv_wait_ms


class GatewayMetrics:
    """The gateway's registry. `load` is the scheduler's (waiting, running, free KV slots, ready); `kv_slots`, the
    serving mesh's KV slots, is set by the observer from the mesh each step runs on (the coordinator's
    `--kv-slots`, the same for every mesh it publishes).

    Every metric about requests (counts, tokens, latencies, resumptions) carries a `model_name` label, as vLLM's
    do, so dashboards that read several servers can tell the models apart: the name clients use for the model,
    `served_model_name` (`--served-model-name`), else the coordinator's name for it (its `--model` as given), which
    `mesh_changed` follows. The mesh's own metrics (steps, batches, queue, KV slots) have no label: a gateway
    serves one model."""

    def __init__(self, load: Callable[[], tuple[int, int, int, bool]], served_model_name: str | None = None,
                 blocks: Callable[[], PoolStats | None] | None = None) -> None:  # fmt: skip
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.kv_slots = 0  # none known before the first step
        self._fixed_name = bool(served_model_name)
        self.model_name = ""  # the label's value (`_named`); "" until a topology names the model
        self.registry = r = CollectorRegistry(auto_describe=True)
        b = telemetry.REQUEST_BUCKETS
        m = ["model_name"]
        self.request_seconds = Histogram("shardmesh_request_duration_seconds", "Arrival to last token, by outcome",
                                         [*m, "finish_reason"], registry=r, buckets=b)  # fmt: skip
        self.ttft = Histogram("shardmesh_time_to_first_token_seconds", "Arrival to first token", m, registry=r,
                              buckets=b)  # fmt: skip
        self.itl = Histogram("shardmesh_inter_token_latency_seconds", "Between consecutive tokens of a request", m,
                             registry=r, buckets=telemetry.STEP_BUCKETS)  # fmt: skip
        self.queue_seconds = Histogram("shardmesh_queue_wait_seconds", "Arrival to first step", m, registry=r,
                                       buckets=b)  # fmt: skip
        self.requests = Counter("shardmesh_requests", "Requests ended, by outcome", [*m, "outcome"], registry=r)
        self.generated = Counter("shardmesh_generated_tokens", "Tokens generated", m, registry=r)
        self.prompt = Counter("shardmesh_prompt_tokens", "Prompt tokens of finished requests", m, registry=r)
        self.batch_size = Histogram("shardmesh_batch_size", "Sequences per step", registry=r,
                                    buckets=telemetry.BATCH_BUCKETS)  # fmt: skip
        self.batch_tokens = Histogram("shardmesh_batch_tokens", "Tokens per step", registry=r,
                                      buckets=telemetry.BATCH_BUCKETS)  # fmt: skip
        self.step_seconds = Histogram("shardmesh_step_duration_seconds", "One step over every shard, as the gateway "
                                      "waits for it", registry=r, buckets=telemetry.STEP_BUCKETS)  # fmt: skip
        self.step_failures = Counter("shardmesh_step_failures", "Steps a shard failed", registry=r)
        self.resumed = Counter("shardmesh_resumed_requests", "Running requests that lost their workers and replayed "
                               "their token log on a new mesh", m, registry=r)  # fmt: skip
        self.replayed = Counter("shardmesh_replayed_tokens", "Log tokens prefilled again by resumed requests", m,
                                registry=r)  # fmt: skip
        self.resume_gap = Histogram("shardmesh_resume_gap_seconds", "The pause a resumed request's client saw: from "
                                    "its last token (or arrival) before the loss to its first token after", m,
                                    registry=r, buckets=telemetry.REQUEST_BUCKETS)  # fmt: skip
        for name, doc, i in (("shardmesh_queue_depth", "Requests waiting for a KV slot", 0),
                             ("shardmesh_running_requests", "Requests holding a KV slot", 1),
                             ("shardmesh_free_kv_slots", "KV slots free for new requests", 2),
                             ("shardmesh_mesh_ready", "1 while a complete mesh serves requests", 3)):  # fmt: skip
            Gauge(name, doc, registry=r).set_function(lambda i=i: float(load()[i]))
        Gauge("shardmesh_kv_cache_usage_ratio", "Share of the serving mesh's KV slots held by requests (0 to 1; 0 "
              "while no mesh serves)", registry=r).set_function(lambda: self.kv_usage(load()))  # fmt: skip
        if blocks is not None:
            r.register(_BlockCollector(blocks))
        self._named(served_model_name or "")

    def _named(self, name: str) -> None:
        """The label's value from now on; the series of a new name exist at once (at 0), so rates start there."""
        self.model_name = name
        if name:
            for metric in (self.ttft, self.itl, self.queue_seconds, self.generated, self.prompt, self.resumed,
                           self.replayed, self.resume_gap):  # fmt: skip
                metric.labels(name)

    def mesh_changed(self, state: MeshState) -> None:
        """A topology from the coordinator (a `MeshSource` subscriber): without `--served-model-name`, the label
        is the coordinator's name for the model."""
        if not self._fixed_name and state.topology is not None and served_model(state) != self.model_name:
            self._named(served_model(state))

    def kv_usage(self, load: tuple[int, int, int, bool]) -> float:
        """Used slots over the mesh's slots: those not free at the next step boundary (as `free_kv_slots`)."""
        free, ready = load[2], load[3]
        if not ready or self.kv_slots <= 0:
            return 0.0
        return min(1.0, max(0.0, (self.kv_slots - free) / self.kv_slots))


class _BlockCollector:
    """A paged mesh's KV blocks (the gateway allocates them for every shard: `gateway/blocks.py`) and what prefix
    caching saved. Nothing while the mesh has slots."""

    def __init__(self, stats: Callable[[], PoolStats | None]) -> None:
        self._stats = stats

    def describe(self) -> list[Any]:
        return []  # collected on each scrape only: the families exist only on a paged mesh

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = self._stats()
        if s is None:
            return
        doc = (
            "KV blocks of every shard, by state: used (held by sequences), cached (a prompt prefix nobody holds, "
            "evicted when needed), free; reserved: promised to running sequences, not taken yet"
        )
        blocks = GaugeMetricFamily("shardmesh_kv_blocks", doc, labels=["state"])
        for state in ("used", "cached", "free", "reserved"):
            blocks.add_metric([state], getattr(s, state))
        yield blocks
        yield GaugeMetricFamily("shardmesh_kv_block_size", "Tokens per KV block", value=s.block_size)
        p = s.prefix
        for name, doc, value in (
            ("shardmesh_prefix_cache_lookups", "Admissions that looked up a cached prompt prefix", p.lookups),
            ("shardmesh_prefix_cache_hits", "Lookups that found at least one cached block", p.hits),
            ("shardmesh_prefix_cache_tokens_looked_up", "Prompt tokens of those lookups", p.tokens_looked_up),
            ("shardmesh_prefix_cache_tokens_saved", "Prompt tokens found cached, not prefilled", p.tokens_saved),
        ):
            yield CounterMetricFamily(name, doc, value=value)


class GatewayObserver:
    """The scheduler's and servicer's one handle on tracing and metrics."""

    def __init__(self, tracer: Any = None, metrics: GatewayMetrics | None = None,
                 trace_decode_steps: int = DEFAULT_TRACE_DECODE_STEPS) -> None:  # fmt: skip
        self.tracer = tracer
        self.metrics = metrics
        self.trace_decode_steps = trace_decode_steps

    # -- requests (RPC threads) -----------------------------------------------------------------------

    def start_request(self, method: str, metadata: Any, request_id: str) -> RequestTrace | None:
        if self.tracer is None:
            return None
        from opentelemetry.trace import SpanKind

        span = self.tracer.start_span(
            f"{SERVICE_NAME}/{method}", context=telemetry.extract(metadata), kind=SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.service": SERVICE_NAME, "rpc.method": method,
                        "shardmesh.request_id": request_id},
        )  # fmt: skip
        return RequestTrace(self.tracer, span)

    @staticmethod
    def end_request(trace: RequestTrace, error: BaseException | None = None, code: str = "") -> None:
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            trace.span.set_status(Status(StatusCode.ERROR, f"{code}: {error}" if code else str(error)))
            trace.span.set_attribute("error.type", code or type(error).__qualname__)
            if code:
                trace.span.set_attribute("rpc.grpc.status_code_name", code)
        trace.span.end()

    def request_errored(self, code: str) -> None:
        """A request that ended with an error status (refused, or failed while running). CANCELLED is
        not counted here: a cancelled request was already counted by its finish reason."""
        if self.metrics is not None and code != "CANCELLED":
            self.metrics.requests.labels(self.metrics.model_name, code.lower()).inc()

    # -- the scheduler thread -------------------------------------------------------------------------

    def step_started(self, step_id: int, view: MeshView, planned: Sequence[Any], in_flight: int = 1,
                     after_step_id: int = 0, decode_steps: int = 1) -> StepTrace | None:  # fmt: skip
        """Spans for the traced requests in this step (None when none is traced). `in_flight`: steps in
        flight once this one is sent (the pipeline's fill), `after_step_id`: the step it runs after, `decode_steps`:
        the decode steps the call runs (a `step.decode` span, and one count of a request's `decode.steps`, stands
        for that many tokens)."""
        if self.metrics is not None:
            self.metrics.kv_slots = view.kv_slots
        if self.tracer is None:
            return None
        chosen: list[tuple[RequestTrace, Any]] = []
        untraced: list[RequestTrace] = []
        for p in planned:
            t = p.seq.trace
            if t is None or not t.recording:
                continue
            if p.seq.prefilling:
                t.prefill_steps += 1
                chosen.append((t, p))
            else:
                t.decode_steps += 1
                if t.decode_steps <= self.trace_decode_steps:
                    chosen.append((t, p))
                else:
                    untraced.append(t)
        if not chosen and not untraced:
            return None
        spans = []
        if chosen:
            ids = [p.seq.req.request_id for p in planned[:MAX_BATCH_IDS]]
            common = {"shardmesh.step_id": step_id, "shardmesh.topology_version": view.version,
                      "shardmesh.batch.entries": len(planned),
                      "shardmesh.batch.tokens": sum(p.num_tokens for p in planned),
                      "shardmesh.batch.request_ids": ids, "shardmesh.shards": len(view.shards),
                      "shardmesh.step.in_flight": in_flight, "shardmesh.step.after_step_id": after_step_id,
                      "shardmesh.step.decode_steps": decode_steps}  # fmt: skip
            for t, p in chosen:
                prefill = p.seq.prefilling
                attributes = {**common, "shardmesh.request_id": p.seq.req.request_id,
                              "shardmesh.entry.start_pos": p.seq.cached,
                              "shardmesh.entry.tokens": p.num_tokens}  # fmt: skip
                if not prefill:
                    attributes["shardmesh.decode.index"] = t.decode_steps
                spans.append(t.child("step.prefill" if prefill else "step.decode", attributes=attributes))
        metadata = telemetry.step_metadata(spans) if spans else None
        return StepTrace(spans, untraced, metadata, time.monotonic())

    def step_done(self, trace: StepTrace | None, entries: int, tokens: int, seconds: float,
                  response: worker_pb2.StepResponse | None, error: str = "") -> None:  # fmt: skip
        if trace is not None:
            trace.end(response, error)
        m = self.metrics
        if m is not None:
            if error:
                m.step_failures.inc()
            else:
                m.batch_size.observe(entries)
                m.batch_tokens.observe(tokens)
                m.step_seconds.observe(seconds)

    def request_finished(self, trace: RequestTrace | None, summary: Summary) -> None:
        if trace is not None:
            trace.finished(summary, self.trace_decode_steps)
        m = self.metrics
        if m is not None:
            t, name = summary.timings, m.model_name
            m.requests.labels(name, summary.finish_reason.value).inc()
            m.request_seconds.labels(name, summary.finish_reason.value).observe(t.total_ms / 1e3)
            m.queue_seconds.labels(name).observe(t.queue_ms / 1e3)
            m.generated.labels(name).inc(summary.completion_tokens)
            m.prompt.labels(name).inc(summary.prompt_tokens)
            if summary.completion_tokens:
                m.ttft.labels(name).observe(t.time_to_first_token_ms / 1e3)
            itl = m.itl.labels(name)
            for ms in t.inter_token_ms:
                itl.observe(ms / 1e3)

    def request_resumed(self, trace: RequestTrace | None, reason: str, replay_tokens: int, waited_s: float) -> None:
        if trace is not None:
            trace.resumed(reason, replay_tokens, waited_s)
        if self.metrics is not None:
            self.metrics.resumed.labels(self.metrics.model_name).inc()
            self.metrics.replayed.labels(self.metrics.model_name).inc(replay_tokens)

    def resume_gap(self, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.resume_gap.labels(self.metrics.model_name).observe(seconds)

    def request_failed(self, trace: RequestTrace | None, error: Exception) -> None:
        """Counted by the servicer, which turns the error into a status (`request_errored`)."""
        if trace is not None:
            trace.failed(error, self.trace_decode_steps)
