"""The live KV-cache dashboard: a static page at ``/dashboard`` and its JSON state.

``add_dashboard_routes`` puts these routes on a FastAPI app:

* ``GET  /dashboard``             the page (``static/dashboard.html`` + ``.js`` + ``.css``);
* ``GET  /dashboard/state``       block maps, pool and engine stats, router decisions and
  latency percentiles as JSON (``max_cells`` bounds the cells per pool; larger
  pools come as density maps);
* ``GET  /dashboard/{asset}``     the page's script and style sheet (public: static code);
* ``POST /dashboard/login``       a browser's way to present the API key: it is kept in
  an HttpOnly, SameSite=Strict cookie scoped to the dashboard's path.

The page and its state check the same API key as the API (``Authorization:
Bearer`` or that cookie). ``DashboardState`` answers from one snapshot shared
by every open page (0.5 s old at most, longer only for pools so large that
drawing them would otherwise take over 5% of a worker's time), so the number
of open dashboards does not change the load on the cluster. Block maps are
asked of the workers (each draws its own pool between two engine steps); the
central KV manager only adds its counters.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import html
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import parse_qs

from fastapi import Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from ..stats import gather_stats

STATIC_DIR = Path(__file__).parent / "static"
ASSETS = {"dashboard.js": "text/javascript; charset=utf-8", "dashboard.css": "text/css; charset=utf-8"}
COOKIE_NAME = "pagedserve_dashboard_key"
DEFAULT_MAX_CELLS = 4096
MIN_MAX_CELLS = 16
MAX_MAX_CELLS = 16384
QUANTILES = (0.5, 0.9, 0.99)
MAX_WORKER_SHARE = 0.05  # the dashboard may take at most this fraction of a worker's time
MAX_REFRESH_S = 10.0
LATENCY_HISTOGRAMS = {"ttft": "ttft", "tpot": "tpot", "e2e": "e2e"}  # state key -> ServerMetrics attribute


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The ``q`` quantile of a histogram, interpolated within its bucket like Prometheus does.

    ``buckets`` are ``(upper_bound, cumulative_count)`` pairs in increasing
    order, the last one ``+inf``. None when the histogram is empty; a rank in
    the ``+inf`` bucket gives the largest finite bound.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, cumulative in buckets:
        if cumulative >= rank:
            if upper == float("inf"):
                return lower
            if cumulative == below:
                return upper
            return lower + (upper - lower) * (rank - below) / (cumulative - below)
        lower, below = upper, cumulative
    return lower


def latency_summary(histogram) -> dict:
    """Count, sum and ``QUANTILES`` of a prometheus_client ``Histogram`` (all label sets summed)."""
    bounds: dict[float, float] = {}
    count = total = 0.0
    for family in histogram.collect():
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                bound = float(sample.labels["le"])
                bounds[bound] = bounds.get(bound, 0.0) + sample.value
            elif sample.name.endswith("_count"):
                count += sample.value
            elif sample.name.endswith("_sum"):
                total += sample.value
    buckets = sorted(bounds.items())
    summary = {"count": int(count), "sum": total, "mean": total / count if count else None}
    for q in QUANTILES:
        summary[f"p{round(q * 100)}"] = histogram_quantile(q, buckets)
    return summary


class DashboardState:
    """The dashboard's JSON state for one server, cached for ``ttl_s`` seconds.

    ``handle`` is a ``ClusterHandle``, read through the cluster's one stats
    gatherer (``cluster.stats.gather_stats``) plus its ``roles``; ``metrics`` a
    ``ServerMetrics`` whose latency histograms give the percentiles (the
    same ones ``/metrics`` exports), or None. Concurrent callers share one
    fetch; a part that fails or does not answer within ``timeout_s`` is
    reported under ``errors`` and left out, never raised.

    Large pools make a worker's ``block_map`` slower; the snapshot is then kept
    longer (up to ``MAX_REFRESH_S``), so that the dashboard takes at most
    ``MAX_WORKER_SHARE`` of a worker's time. ``refresh_s`` (also in
    the state) is how old a snapshot may be.
    """

    def __init__(self, handle, metrics=None, ttl_s: float = 0.5, timeout_s: float = 5.0) -> None:
        if ttl_s < 0 or timeout_s <= 0:
            raise ValueError(f"ttl_s must be >= 0 and timeout_s > 0, got {ttl_s} and {timeout_s}")
        self.handle = handle
        self.metrics = metrics
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.num_fetches = 0
        self.refresh_s = ttl_s
        self._cache: dict[int, tuple[float, dict]] = {}
        self._pending: dict[int, asyncio.Future] = {}

    async def get(self, max_cells: int = DEFAULT_MAX_CELLS) -> dict:
        """The state with at most ``max_cells`` cells per pool, at most ``refresh_s`` old."""
        if isinstance(max_cells, bool) or not isinstance(max_cells, int):
            raise TypeError(f"max_cells must be an int, got {type(max_cells).__name__}")
        if not MIN_MAX_CELLS <= max_cells <= MAX_MAX_CELLS:
            raise ValueError(f"max_cells must be in [{MIN_MAX_CELLS}, {MAX_MAX_CELLS}], got {max_cells}")
        cached = self._cache.get(max_cells)
        if cached is not None and time.monotonic() - cached[0] < self.refresh_s:
            return cached[1]
        pending = self._pending.get(max_cells)
        if pending is None:
            pending = asyncio.ensure_future(self._fetch(max_cells))
            self._pending[max_cells] = pending
            pending.add_done_callback(lambda _: self._pending.pop(max_cells, None))
        return await asyncio.shield(pending)

    async def _fetch(self, max_cells: int) -> dict:
        handle = self.handle
        started = time.monotonic()
        stats = await gather_stats(handle, self.timeout_s, block_map_cells=max_cells)
        if stats["block_maps"]:  # the slow part: keep the workers' share of time bounded
            elapsed = time.monotonic() - started
            self.refresh_s = min(MAX_REFRESH_S, max(self.ttl_s, elapsed / MAX_WORKER_SHARE))
        pools = stats["kv_manager"].get("workers", {})
        roles = getattr(handle, "roles", {})
        workers = {}
        for worker_id, engine in stats["workers"].items():
            answered = "error" not in engine
            workers[worker_id] = {
                "role": roles.get(worker_id, "mixed"),
                "is_healthy": bool(answered and engine.get("is_healthy")),
                "tiers": stats["block_maps"].get(worker_id, {}).get("tiers", {}),
                "pool": pools.get(worker_id),
                "engine": engine if answered else None,
            }
        state = {
            "time": stats["time"],
            "model": stats["model"],
            "max_cells": max_cells,
            "refresh_s": self.refresh_s,
            "workers": workers,
            "kv_manager": {k: v for k, v in stats["kv_manager"].items() if k not in ("workers", "error")},
            "router": stats["router"],
            "decisions": stats["recent_decisions"],
            "latency": self.latency(),
            "errors": stats["errors"],
        }
        self.num_fetches += 1
        now = time.monotonic()
        self._cache = {k: v for k, v in self._cache.items() if now - v[0] < self.refresh_s}
        self._cache[max_cells] = (now, state)
        return state

    def latency(self) -> dict:
        """TTFT, TPOT and end-to-end latency summaries from ``metrics`` (empty without it)."""
        if self.metrics is None:
            return {}
        return {key: latency_summary(getattr(self.metrics, attr)) for key, attr in LATENCY_HISTOGRAMS.items()}


def _page(base: str) -> str:
    return (STATIC_DIR / "dashboard.html").read_text(encoding="utf-8").replace("__BASE__", html.escape(base))


def _login_page(base: str, message: str) -> str:
    return (STATIC_DIR / "login.html").read_text(encoding="utf-8").replace(
        "__BASE__", html.escape(base)).replace("__MESSAGE__", html.escape(message))


def add_dashboard_routes(app, handle, check_auth: Callable[[str | None], None], metrics=None,
                         path: str = "/dashboard", ttl_s: float = 0.5) -> DashboardState:
    """Serve the dashboard on ``app`` under ``path``; returns the state source it uses.

    ``check_auth(authorization_header)`` must raise (any exception) to refuse
    a request: the server's API-key check. A browser may instead present the
    key through the login form, which sets a cookie the routes accept too.
    Unauthorised page loads get the login form (401); the JSON a JSON 401 in
    OpenAI's error shape.
    """
    if not path.startswith("/") or path.endswith("/"):
        raise ValueError(f"path must start with '/' and not end with one, got {path!r}")
    state = DashboardState(handle, metrics, ttl_s=ttl_s)

    def base_of(request: Request, suffix: str = "") -> str:
        """The dashboard's own URL path as the client sees it (behind a route prefix too)."""
        url_path = request.url.path.rstrip("/")
        return url_path[:len(url_path) - len(suffix)] if suffix and url_path.endswith(suffix) else url_path

    def auth_error(request: Request) -> str | None:
        header = request.headers.get("authorization")
        if not header and request.cookies.get(COOKIE_NAME):
            try:  # the key travels base64url-encoded, so any key survives cookie quoting
                header = "Bearer " + base64.urlsafe_b64decode(request.cookies[COOKIE_NAME]).decode()
            except (binascii.Error, ValueError):
                header = None
        try:
            check_auth(header)
        except Exception as exc:  # the server's check raises its own error type
            return getattr(exc, "message", None) or str(exc) or "missing or invalid API key"
        return None

    def unauthorized_json(message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "authentication_error", "param": None,
                                       "code": "invalid_api_key"}}, status_code=401)

    no_store = {"Cache-Control": "no-store"}

    @app.get(path, include_in_schema=False)
    async def dashboard_page(request: Request):
        base = base_of(request)
        error = auth_error(request)
        if error is not None:
            return HTMLResponse(_login_page(base, error), status_code=401, headers=no_store)
        return HTMLResponse(_page(base), headers=no_store)

    @app.post(path + "/login", include_in_schema=False)
    async def dashboard_login(request: Request):
        base = base_of(request, "/login")
        body = await request.body()
        if len(body) > 4096:
            return HTMLResponse(_login_page(base, "the form is too large"), status_code=413)
        key = (parse_qs(body.decode("utf-8", "replace")).get("key") or [""])[0].strip()
        try:
            check_auth(f"Bearer {key}")
        except Exception:
            return HTMLResponse(_login_page(base, "wrong API key"), status_code=401, headers=no_store)
        response = RedirectResponse(base, status_code=303)
        response.set_cookie(COOKIE_NAME, base64.urlsafe_b64encode(key.encode()).decode(), path=base,
                            httponly=True, samesite="strict",
                            secure=request.url.scheme == "https")
        return response

    @app.get(path + "/state", include_in_schema=False)
    async def dashboard_state(request: Request, max_cells: int = DEFAULT_MAX_CELLS):
        error = auth_error(request)
        if error is not None:
            return unauthorized_json(error)
        try:
            body = await state.get(max_cells)
        except ValueError as exc:
            return JSONResponse({"error": {"message": str(exc), "type": "invalid_request_error",
                                           "param": "max_cells", "code": None}}, status_code=400)
        return JSONResponse(body, headers=no_store)

    @app.get(path + "/{asset}", include_in_schema=False)
    async def dashboard_asset(asset: str):
        if asset not in ASSETS:
            return JSONResponse({"error": {"message": f"no dashboard asset {asset!r}", "type": "not_found_error",
                                           "param": None, "code": None}}, status_code=404)
        return Response((STATIC_DIR / asset).read_bytes(), media_type=ASSETS[asset],
                        headers={"Cache-Control": "no-cache"})

    return state


__all__ = ["DashboardState", "add_dashboard_routes", "histogram_quantile", "latency_summary"]
