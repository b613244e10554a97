"""Prometheus metrics for every service: one registry per process, served on its own port.

Each service makes its metrics with `registry()` and serves them with `serve(port, registry)`
(prometheus_client's own HTTP server, on a thread; port 0 = not served). The gateway also
serves its registry on its API port at /metrics. Names are `moonbus_<service>_...`; the
Prometheus scrape config and a Grafana dashboard over them are in docker/.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger(__name__)

# latency buckets, seconds: from a fast route (100 us) to a slow prefill (a minute)
FAST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
RATIO_BUCKETS = (0.5, 0.8, 0.9, 1.0, 1.1, 1.2, 1.5, 2.0, 3.0, 5.0)  # actual / predicted: 1 is exact
SLOW_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def registry() -> CollectorRegistry:
    return CollectorRegistry()


def serve(port: int, registry: CollectorRegistry, host: str = "0.0.0.0") -> None:
    """Serve the registry at http://host:port/metrics (nothing when port is 0)."""
    if port:
        start_http_server(port, addr=host, registry=registry)
        log.info("metrics on http://%s:%d/metrics", host, port)
