"""Prometheus export: the latest step metrics as gauges and running totals as counters.

Served over HTTP on 127.0.0.1 only (a training run's figures are not for the network at large).
Each exporter has its own registry, so several runs in one process do not collide. ``prometheus_client``
(the ``obs`` extra) is imported when an exporter is created.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from stalebound.core import ConfigError
from stalebound.obs.records import STATE_NAMES, BufferRow

__all__ = ["PrometheusExporter", "metric_name"]

_INVALID = re.compile(r"[^a-zA-Z0-9_]")


def metric_name(key: str, prefix: str = "stalebound_") -> str:
    """A Prometheus metric name for a step-metric key: other characters become ``_``."""
    name = prefix + _INVALID.sub("_", key)
    return name if not name[0].isdigit() else "_" + name


class PrometheusExporter:
    """Gauges and counters for one run, served at ``http://127.0.0.1:<port>/metrics``.

    ``port=0`` picks a free port; :attr:`port` tells which.
    """

    def __init__(self, port: int, *, host: str = "127.0.0.1") -> None:
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ConfigError(
                f"prometheus_port={port!r}: must be an int in 0 … 65535 (0 picks a free port)"
            )
        import prometheus_client as prom

        self._prom: Any = prom
        self.registry: Any = prom.CollectorRegistry()
        self._gauges: dict[str, Any] = {}
        self._step = prom.Gauge(
            "stalebound_step", "Last training step logged", registry=self.registry
        )
        self._version = prom.Gauge(
            "stalebound_version", "Policy version after the last step", registry=self.registry
        )
        self._steps = prom.Counter(
            "stalebound_steps", "Training steps logged", registry=self.registry
        )
        self._trained = prom.Counter(
            "stalebound_trained_items",
            "Trained items by staleness (trained version minus generating version)",
            ["staleness"],
            registry=self.registry,
        )
        self._entries = prom.Gauge(
            "stalebound_buffer_entries",
            "Buffer entries by offset from the training version and entry state",
            ["offset", "state"],
            registry=self.registry,
        )
        self._buffer_state = prom.Gauge(
            "stalebound_buffer_state",
            "1 for the state each buffer (by offset from the training version) is in, else 0",
            ["offset", "state"],
            registry=self.registry,
        )
        try:
            self._server, self._thread = prom.start_http_server(
                port, addr=host, registry=self.registry
            )
        except OSError as exc:
            raise ConfigError(
                f"prometheus_port={port}: cannot listen on {host}:{port} ({exc}); choose a free "
                "port or 0"
            ) from None
        self.host = host
        self.port: int = self._server.server_port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def record_step(
        self,
        step: int,
        version: int | None,
        metrics: Mapping[str, float],
        staleness: Mapping[int, int],
    ) -> None:
        self._step.set(step)
        if version is not None:
            self._version.set(version)
        self._steps.inc()
        for key, value in metrics.items():
            gauge = self._gauges.get(key)
            if gauge is None:
                gauge = self._prom.Gauge(
                    metric_name(key), f"Step metric {key}", registry=self.registry
                )
                self._gauges[key] = gauge
            gauge.set(value)
        for k, n in staleness.items():
            self._trained.labels(staleness=str(k)).inc(n)

    def record_buffers(self, version: int, rows: Sequence[BufferRow]) -> None:
        for row in rows:
            offset = str(row.version - version)
            self._entries.labels(offset=offset, state="occupied").set(row.occupied)
            self._entries.labels(offset=offset, state="reserved").set(row.reserved)
            self._entries.labels(offset=offset, state="empty").set(row.empty)
            for name in STATE_NAMES:
                self._buffer_state.labels(offset=offset, state=name).set(int(row.state == name))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
