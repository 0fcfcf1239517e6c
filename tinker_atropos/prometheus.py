"""Prometheus metrics of a service process, on an HTTP port of its own (``--metrics-port``), for operators.

What a scrape returns is read at scrape time from the same status the service serves over gRPC and writes to the
registry, so the three views never disagree: each numeric field of its status message is a series
``tinker_atropos_<kind>_<field>`` (a counter when the field only grows, a gauge otherwise), map fields are
labelled series (``loss``, ``reason``, ``lag``), text fields are labels of ``tinker_atropos_<kind>_service_info``.
Every gRPC call the service handled is counted by method and status code in ``grpc_server_handled_total``, the
name go-grpc-prometheus and the Grafana dashboards built on it use. Every series carries the ``run`` label.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

# Status fields that go up and down; every other number only grows (a counter).
GAUGES = frozenset(
    {
        "instances",
        "free_instances",
        "sessions",
        "streams",
        "connected_sessions",
        "policy_version",
        "busy_fraction",
        "policy_lag_min",
        "policy_lag_mean",
        "policy_lag_max",
        "episode_return_mean",
        "losses",
        "policy_lag_counts",
        "eval_policy_version",
        "eval_return_mean",
        "eval_return_std",
        "eval_best_policy_version",
        "eval_best_return_mean",
        "write_failing_s",
        "step",
        "queue_groups",
        "queue_sequences",
        "pending_batches",
        "envs_registered",
        "envs_connected",
        "instances_held",
        "instances_by_env",
        "units_assigned",
        "rollouts_seen",
    }
)
MAP_LABELS = {
    "losses": "loss",
    "records_rejected": "reason",
    "weights_refused": "reason",
    "policy_lag_counts": "lag",
    "writes_failed": "what",
    "instances_by_env": "env",
    "lease_records_skipped": "reason",
    "tinker_events": "event",
}


class CallCounter(grpc.ServerInterceptor):
    """Counts each call by (method, status code) when it ends: OK, the code it aborted with, CANCELLED for a
    stream its client cancelled. Outermost interceptor, so calls refused for their token count too."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None:  # no such method: gRPC answers UNIMPLEMENTED itself
            return None
        method = details.method
        if handler.unary_unary:
            return handler._replace(unary_unary=self._unary(method, handler.unary_unary))
        if handler.stream_unary:
            return handler._replace(stream_unary=self._unary(method, handler.stream_unary))
        if handler.unary_stream:
            return handler._replace(unary_stream=self._streaming(method, handler.unary_stream))
        return handler._replace(stream_stream=self._streaming(method, handler.stream_stream))

    def _count(self, method: str, code: grpc.StatusCode | None) -> None:
        with self._lock:
            self.counts[(method, (code or grpc.StatusCode.OK).name)] += 1

    def _unary(self, method: str, behaviour: Callable) -> Callable:
        def call(request: Any, context: grpc.ServicerContext) -> Any:
            try:
                response = behaviour(request, context)
            except BaseException:
                self._count(method, context.code() or grpc.StatusCode.UNKNOWN)
                raise
            self._count(method, context.code())
            return response

        return call

    def _streaming(self, method: str, behaviour: Callable) -> Callable:
        def call(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                yield from behaviour(request, context)
            except GeneratorExit:  # the client went away mid-stream
                self._count(method, grpc.StatusCode.CANCELLED)
                raise
            except BaseException:
                self._count(method, context.code() or grpc.StatusCode.UNKNOWN)
                raise
            self._count(method, context.code())

        return call


class ServiceCollector(Collector):
    """The service's status as Prometheus series, read at each scrape."""

    def __init__(
        self, kind: str, run: str, figures: Callable[[], dict[str, Any]], calls: CallCounter
    ) -> None:
        self.kind, self.run, self._figures, self._calls = kind, run, figures, calls

    def collect(self) -> Iterator[Metric]:
        prefix = f"tinker_atropos_{self.kind}_"
        figures = self._figures()
        texts = {name: value for name, value in figures.items() if isinstance(value, str) and value}
        yield InfoMetricFamily(
            prefix + "service", f"the {self.kind} service's identity", {**texts, "run": self.run}
        )
        for name, value in sorted(figures.items()):
            if isinstance(value, str):
                continue
            kind = GaugeMetricFamily if name in GAUGES else CounterMetricFamily
            what = f"{self.kind} status field {name}" + ("" if name in GAUGES else " (only grows)")
            if isinstance(value, dict):
                family = kind(prefix + name, what, labels=["run", MAP_LABELS.get(name, "key")])
                for key, number in sorted(value.items(), key=lambda item: str(item[0])):
                    family.add_metric([self.run, str(key)], float(number))
            else:
                family = kind(prefix + name, what, labels=["run"])
                family.add_metric([self.run], float(value))
            yield family
        handled = CounterMetricFamily(
            "grpc_server_handled",
            "gRPC calls completed on the server, by method and status code",
            labels=["run", "grpc_method", "grpc_code"],
        )
        with self._calls._lock:
            counts = sorted(self._calls.counts.items())
        for (method, code), count in counts:
            handled.add_metric([self.run, method, code], count)
        yield handled


def serve_metrics(host: str, port: int, collector: ServiceCollector) -> Any:
    """The metrics HTTP server on ``host:port`` (0: a free port), in a daemon thread; ``.server_port`` is the
    port bound, ``.shutdown()`` stops it."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server
