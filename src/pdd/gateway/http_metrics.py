"""HTTP responses of the gateway on ``/metrics`` (:class:`HttpMetrics`), as vLLM's
``http_requests_total`` / ``http_request_duration_seconds`` (prometheus-fastapi-instrumentator)
count them: every request answered, by route, method and status, and its time to the end of
its response, 4xx refusals included (admission's and the concurrency limit's 429, a 400, the
drain's 503), which no other counter shows by status. Labels stay bounded: the route's path
template, ``none`` for a path no route serves.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from starlette.routing import Match

# seconds from a request's arrival to the end of its response (a stream's whole life)
HTTP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
NO_ROUTE = "none"  # the handler label of a path no route serves (a 404), so labels stay bounded
NO_RESPONSE = "none"  # the status label of a request that ended with no response started (the client left)
METHODS = frozenset({"GET", "POST", "HEAD", "PUT", "DELETE", "PATCH", "OPTIONS"})  # any other is "other"


class HttpCounters:
    """The two metrics, on ``registry``: ``pdd_gateway_http_requests_total{handler,method,status}``
    (``status``: the HTTP code, e.g. ``200``, ``429``; ``method``: the request's, ``other`` for
    one outside :data:`METHODS`) and
    ``pdd_gateway_http_request_duration_seconds{handler,method}``."""

    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter("pdd_gateway_http_requests", "HTTP requests the gateway answered, by route (its path "
                                "template; none: no route serves the path), method and status code (none: the client "
                                "left before a response started)", ["handler", "method", "status"],
                                registry=registry)
        self.duration = Histogram("pdd_gateway_http_request_duration_seconds", "an HTTP request's time at the "
                                  "gateway, from its arrival to the end of its response (a stream's to its last "
                                  "chunk), by route and method", ["handler", "method"], buckets=HTTP_BUCKETS,
                                  registry=registry)


def handler_of(scope: dict, routes) -> str:
    """The route label of a request: the path template of the route that served it (FastAPI
    records it in ``scope["route"]``), else of the first of ``routes`` whose path matches (a
    request refused before routing: a 429, a 503, a 405 of the wrong method), else
    :data:`NO_ROUTE`."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    if path:
        return path
    for r in routes:
        match, _ = r.matches(scope)
        if match is not Match.NONE:
            return getattr(r, "path", NO_ROUTE)
    return NO_ROUTE


class HttpMetrics:
    """ASGI middleware, the outermost: counts each HTTP request once its response has ended (or
    the app raised: status 500, as the server answers) in ``counters``; ``routes`` is the app's
    routes (:func:`handler_of`). Other scopes (lifespan) pass untouched."""

    def __init__(self, app, counters: HttpCounters, routes):
        self.app, self.counters, self.routes = app, counters, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = NO_RESPONSE

        async def send_seen(msg):
            nonlocal status
            if msg["type"] == "http.response.start":
                status = str(msg["status"])
            await send(msg)

        try:
            await self.app(scope, receive, send_seen)
        except Exception:
            if status == NO_RESPONSE:
                status = "500"
            raise
        finally:
            method = scope.get("method", "")
            handler, method = handler_of(scope, self.routes), method if method in METHODS else "other"
            self.counters.requests.labels(handler, method, status).inc()
            self.counters.duration.labels(handler, method).observe(max(0.0, time.perf_counter() - t0))
