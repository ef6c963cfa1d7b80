"""The KV-cache dashboard: its JSON state, its auth, and the page in a real headless Chromium.

Fast tests drive the routes through FastAPI's test client over a fake cluster
handle (whose KV manager is the real in-process ``KVManagerService`` and whose
worker draws its block map from a real ``LocalKVManager``). The
end-to-end tests start Ray, a two-worker cluster and the Serve application
(with an API key), then check ``/dashboard/state`` and load ``/dashboard`` in
Chromium through the DevTools protocol while requests run. The browser test
skips (with the reason) when Chromium is not installed; CI installs it.
A screenshot is saved to ``artifacts/dashboard.png``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from pagedserve.cluster.serving.dashboard import (DashboardState, add_dashboard_routes, histogram_quantile,
                                                  latency_summary)
from pagedserve.kvmanager import LocalKVManager, PoolConfig
from pagedserve.kvmanager.service import KVManagerService
from served_cluster import cluster_config, running_cluster

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
API_KEY = "dash-key"
NUM_DEVICE_BLOCKS = 96
ENGINE = {"num_device_blocks": NUM_DEVICE_BLOCKS, "swap_space_gb": 0.001}
SHARED_PREFIX = ("The paged KV cache splits every sequence into fixed-size blocks, so memory is "
                 "allocated on demand and shared between requests with the same prefix. ") * 3


# ---- fast tests: no Ray --------------------------------------------------------------------------
class _Method:
    """``.remote(...)`` returning an awaitable, like a Ray actor method."""

    def __init__(self, fn, delay_s: float = 0.0) -> None:
        self.fn = fn
        self.delay_s = delay_s
        self.num_calls = 0

    def remote(self, *args):
        self.num_calls += 1

        async def call():
            await asyncio.sleep(self.delay_s)
            return self.fn(*args)

        return call()


class _FakeActor:
    def __init__(self, obj, names: list[str], delay_s: float = 0.0) -> None:
        for name in names:
            setattr(self, name, _Method(getattr(obj, name), delay_s))


class _FakeRouter:
    def snapshot(self) -> dict:
        return {"loads": {"w0": {"num_in_flight": 0}}, "reasons": {"only": 1}}

    def recent_decisions(self, limit: int) -> list[dict]:
        return [{"request_id": "r1", "worker_id": "w0", "reason": "only", "cached_tokens": 16,
                 "prompt_tokens": 40, "scores": {}, "timestamp": 1.0}][:limit]


class _FakeWorker:
    """A worker without a model: its pools are a real ``LocalKVManager``."""

    def __init__(self, num_device_blocks: int, num_host_blocks: int) -> None:
        self.kv = LocalKVManager()
        self.kv.add_worker("w0", PoolConfig(num_device_blocks=num_device_blocks, num_host_blocks=num_host_blocks))

    def stats(self) -> dict:
        return {"worker_id": "w0", "num_waiting": 1, "num_running": 2, "is_healthy": True,
                "kv_pool": self.kv.stats("w0")}

    def block_map(self, max_cells: int) -> dict:
        return self.kv.block_map("w0", max_cells)


class FakeHandle:
    """The parts of a ``ClusterHandle`` the dashboard reads; the KV manager is the real service."""

    def __init__(self, num_device_blocks: int = 64, num_host_blocks: int = 8, delay_s: float = 0.0) -> None:
        self.service = KVManagerService()
        self.service.register_worker("w0", {"num_device_blocks": num_device_blocks,
                                            "num_host_blocks": num_host_blocks})
        self.kv_manager = _FakeActor(self.service, ["stats"])
        self.workers = {"w0": _FakeActor(_FakeWorker(num_device_blocks, num_host_blocks),
                                         ["stats", "block_map"], delay_s)}
        self.roles = {"w0": "mixed"}
        self.router = _FakeRouter()
        self.model_name = "fake-model"


def _check_key(authorization: str | None) -> None:
    if authorization != f"Bearer {API_KEY}":
        raise PermissionError("missing or invalid API key")


@pytest.fixture
def fake_app():
    fastapi = pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from pagedserve.cluster.serving.metrics import ServerMetrics

    app = fastapi.FastAPI()
    handle = FakeHandle()
    metrics = ServerMetrics("fake-model")
    metrics.observe_generation(0.0, 0.2, 1.2, 10, 0, 11, ["length"])
    state = add_dashboard_routes(app, handle, _check_key, metrics)
    return TestClient(app), handle, state


def test_histogram_quantile_interpolates_like_prometheus():
    buckets = [(0.1, 2.0), (0.5, 6.0), (1.0, 8.0), (math.inf, 10.0)]
    assert histogram_quantile(0.1, buckets) == pytest.approx(0.05)   # rank 1 of 2 in (0, 0.1]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.4)    # rank 5: 3 of 4 into (0.1, 0.5]
    assert histogram_quantile(0.99, buckets) == 1.0                  # in +Inf: the largest finite bound
    assert histogram_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]) is None
    with pytest.raises(ValueError):
        histogram_quantile(1.5, buckets)


def test_latency_summary_reads_server_metrics():
    from pagedserve.cluster.serving.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    for ttft in (0.02, 0.03, 0.2, 0.4):
        metrics.observe_generation(0.0, ttft, 1.0, 8, 0, 5, ["stop"])
    summary = latency_summary(metrics.ttft)
    assert summary["count"] == 4 and summary["sum"] == pytest.approx(0.65)
    assert 0.025 <= summary["p50"] <= 0.05 and 0.25 <= summary["p90"] <= 0.5
    assert latency_summary(metrics.tpot)["count"] == 4


def test_state_route_auth_shape_and_cache(fake_app):
    client, handle, state = fake_app
    assert client.get("/dashboard/state").status_code == 401
    assert client.get("/dashboard/state", headers={"Authorization": "Bearer nope"}).status_code == 401
    auth = {"Authorization": f"Bearer {API_KEY}"}
    body = client.get("/dashboard/state", headers=auth).json()
    tiers = body["workers"]["w0"]["tiers"]
    assert len(tiers["device"]["states"]) == 64 and set(tiers["device"]["states"]) == {"f"}
    assert tiers["host"]["num_blocks"] == 8
    assert body["workers"]["w0"]["engine"]["num_running"] == 2
    assert body["decisions"][0]["reason"] == "only" and body["errors"] == []
    assert body["latency"]["ttft"]["count"] == 1 and body["latency"]["tpot"]["count"] == 1
    # Many readers within the TTL share one block-map call.
    for _ in range(5):
        client.get("/dashboard/state", headers=auth)
    assert handle.workers["w0"].block_map.num_calls == 1 and state.num_fetches == 1
    assert state.refresh_s == state.ttl_s == 0.5  # a fast worker: the shortest refresh
    time.sleep(state.refresh_s + 0.05)
    client.get("/dashboard/state", headers=auth)
    assert handle.workers["w0"].block_map.num_calls == 2
    assert client.get("/dashboard/state?max_cells=3", headers=auth).status_code == 400
    assert client.get("/dashboard/state?max_cells=x", headers=auth).status_code in (400, 422)


def test_concurrent_readers_share_one_fetch():
    handle = FakeHandle()
    state = DashboardState(handle, ttl_s=10.0)

    async def many():
        return await asyncio.gather(*(state.get(256) for _ in range(20)))

    results = asyncio.run(many())
    assert all(r is results[0] for r in results)
    assert handle.workers["w0"].block_map.num_calls == 1


def test_slow_worker_block_map_is_asked_less_often():
    handle = FakeHandle(delay_s=0.1)
    state = DashboardState(handle, ttl_s=0.5)
    body = asyncio.run(state.get(256))
    # >= 0.1 s / 5 %, less the event loop's timer slack (a 0.1 s sleep measured 0.0999 s once).
    assert 1.9 <= state.refresh_s == body["refresh_s"] <= 10.0, (
        f"assumed: the block map's 0.1 s delay sets the refresh to about 2 s; got {state.refresh_s}")


def test_large_pool_comes_as_density_map():
    handle = FakeHandle(num_device_blocks=100_000)
    body = asyncio.run(DashboardState(handle).get(4096))
    device = body["workers"]["w0"]["tiers"]["device"]
    assert "states" not in device and device["blocks_per_cell"] == 25
    assert len(device["density"]) == 4000 and max(device["density"]) == 0.0


def test_page_login_cookie_and_assets(fake_app):
    client, _, _ = fake_app
    page = client.get("/dashboard")
    assert page.status_code == 401 and 'action="/dashboard/login"' in page.text
    assert client.get("/dashboard/dashboard.js").status_code == 200  # static code is public
    assert client.get("/dashboard/secret.py").status_code == 404
    wrong = client.post("/dashboard/login", content="key=nope",
                        headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert wrong.status_code == 401 and "wrong API key" in wrong.text
    login = client.post("/dashboard/login", content=f"key={API_KEY}", follow_redirects=False,
                        headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert login.status_code == 303 and login.headers["location"] == "/dashboard"
    cookie = login.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie and "path=/dashboard" in cookie
    page = client.get("/dashboard")  # the client kept the cookie
    assert page.status_code == 200 and 'src="/dashboard/dashboard.js"' in page.text
    assert client.get("/dashboard/state").status_code == 200


def test_login_cookie_survives_any_key():
    fastapi = pytest.importorskip("fastapi")
    from urllib.parse import quote

    from fastapi.testclient import TestClient

    key = 'k;e y="1",é'
    app = fastapi.FastAPI()

    def check(authorization: str | None) -> None:
        if authorization != f"Bearer {key}":
            raise PermissionError("wrong key")

    add_dashboard_routes(app, FakeHandle(), check)
    client = TestClient(app)
    login = client.post("/dashboard/login", content=f"key={quote(key)}", follow_redirects=False,
                        headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert login.status_code == 303
    assert client.get("/dashboard/state").status_code == 200


# ---- end to end: Ray, a two-worker cluster and the Serve application -----------------------------------
@pytest.fixture(scope="module")
def served(tiny_model):
    pytest.importorskip("ray")
    from pagedserve.cluster.serving.deployment import deploy

    with running_cluster(cluster_config(tiny_model("llama"), "tiny-dash", ENGINE, num_workers=2,
                                        api_key=API_KEY)) as cluster:
        endpoints = deploy(cluster.handle, cluster.config, route_prefix="/ps", quiet=True)
        yield cluster.handle, endpoints["http"]


def _get(url: str, key: str | None = API_KEY) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _complete(base_url: str, prompt: str, max_tokens: int, n: int = 1) -> dict:
    body = json.dumps({"model": "tiny-dash", "prompt": prompt, "max_tokens": max_tokens, "n": n,
                       "temperature": 0.0 if n == 1 else 1.0, "ignore_eos": True}).encode()
    request = urllib.request.Request(base_url + "/v1/completions", data=body, method="POST", headers={
        "Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _metrics(base_url: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    status, text = _get(base_url + "/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode()) for s in family.samples}


def _wait_idle(handle) -> None:
    handle.wait_idle(timeout=60)
    assert handle.num_used_blocks() == 0
    handle.check_integrity()


def test_state_endpoint_on_real_cluster(served):
    handle, base_url = served
    assert _get(base_url + "/dashboard/state", key=None)[0] == 401
    assert _get(base_url + "/dashboard/state", key="wrong")[0] == 401
    _complete(base_url, SHARED_PREFIX + "one", 8)
    _complete(base_url, SHARED_PREFIX + "two", 8)
    _wait_idle(handle)
    time.sleep(0.6)  # past the state's cache
    status, raw = _get(base_url + "/dashboard/state")
    assert status == 200
    state = json.loads(raw)
    assert sorted(state["workers"]) == sorted(handle.workers) and state["errors"] == []
    metrics = _metrics(base_url)
    for worker_id, worker in state["workers"].items():
        device = worker["tiers"]["device"]
        assert device["num_blocks"] == NUM_DEVICE_BLOCKS == len(device["states"])
        assert "u" not in device["states"] and "s" not in device["states"]  # idle: nothing in use
        cached = metrics[("pagedserve_kv_blocks", (("pool", "device"), ("state", "cached"),
                                                   ("worker", worker_id)))]
        assert device["counts"]["c"] == device["states"].count("c") == cached
        assert set(device["hashes"]) == {str(i) for i, st in enumerate(device["states"]) if st == "c"}
        assert worker["is_healthy"] and worker["engine"]["num_running"] == 0
    assert sum(w["tiers"]["device"]["counts"]["c"] for w in state["workers"].values()) > 0
    assert {d["request_id"].rsplit("-", 1)[0][:5] for d in state["decisions"]} == {"cmpl-"}
    ttft_count = metrics[("pagedserve_time_to_first_token_seconds_count", (("model", "tiny-dash"),))]
    assert state["latency"]["ttft"]["count"] == ttft_count >= 2


# ---- the browser ------------------------------------------------------------------------------------
def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """Headless Chromium driven over the DevTools protocol (one page, synchronous calls)."""

    def __init__(self, binary: str, user_data_dir: str) -> None:
        from websockets.sync.client import connect

        self.process = subprocess.Popen(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
             "--disable-extensions", "--mute-audio", f"--user-data-dir={user_data_dir}",
             "--remote-debugging-port=0", "--window-size=1400,1000", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        port_file = Path(user_data_dir) / "DevToolsActivePort"
        deadline = time.time() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            if time.time() > deadline or self.process.poll() is not None:
                self.close()
                raise RuntimeError("chromium did not start its DevTools endpoint")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as response:
            targets = json.loads(response.read())
        page = next(t for t in targets if t["type"] == "page")
        self._exits = contextlib.ExitStack()
        self.ws = self._exits.enter_context(connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=10))
        self._next_id = 0

    def call(self, method: str, timeout: float = 30.0, **params):
        self._next_id += 1
        msg_id = self._next_id
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        deadline = time.time() + timeout
        while True:
            message = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.time())))
            if message.get("id") == msg_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0):
        deadline = time.time() + timeout
        while True:
            try:
                value = self.evaluate(expression)
                if value:
                    return value
            except RuntimeError:  # mid-navigation: no execution context yet
                pass
            if time.time() > deadline:
                raise TimeoutError(f"{expression!r} still false after {timeout} s")
            time.sleep(0.2)

    def navigate(self, url: str) -> None:
        self.call("Page.navigate", url=url)
        self.wait_for(f"document.readyState === 'complete' && location.href === {json.dumps(url)}")

    def screenshot(self, path: Path, full_page: bool = True) -> None:
        """A PNG of the whole page (scrolled to the top first, where the sticky header belongs) or the viewport."""
        if full_page:
            self.evaluate("window.scrollTo(0, 0)")
            metrics = self.call("Page.getLayoutMetrics")["cssContentSize"]
            clip = {"x": 0, "y": 0, "width": metrics["width"], "height": min(metrics["height"], 4000), "scale": 1}
            data = self.call("Page.captureScreenshot", format="png", clip=clip, captureBeyondViewport=True)["data"]
        else:
            data = self.call("Page.captureScreenshot", format="png")["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        if hasattr(self, "_exits"):
            try:
                self._exits.close()
            except Exception:
                pass
        # The browser and its helper processes form the session started for it: end them together.
        for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue


@pytest.fixture
def browser():
    pytest.importorskip("websockets")
    binary = _chromium()
    if binary is None:
        pytest.skip("chromium is not installed (as root: apt-get update && apt-get install -y chromium)")
    with tempfile.TemporaryDirectory(prefix="pagedserve-chromium-", ignore_cleanup_errors=True) as user_data_dir:
        instance = Browser(binary, user_data_dir)
        try:
            yield instance
        finally:
            instance.close()


GRID_STATES_JS = """(() => {
  const out = {};
  for (const grid of document.querySelectorAll('.grid[data-tier="device"]')) {
    out[grid.dataset.worker] = Array.from(grid.querySelectorAll('.cell'))
      .map(c => c.className.replace('cell s-', '')).join('');
  }
  return out;
})()"""


def _metric_value(browser: Browser, name: str) -> float | None:
    value = browser.evaluate(f"(document.querySelector('[data-metric={json.dumps(name)}]') || {{}}).dataset?.value")
    return None if value is None else float(value)


def test_dashboard_in_headless_chromium(served, browser):
    handle, base_url = served
    page_url = base_url + "/dashboard"
    # Without the key: the sign-in form; with it (the cookie), the live page.
    browser.navigate(page_url)
    assert browser.evaluate("!!document.getElementById('login-form')")
    browser.evaluate(f"document.getElementById('key').value = {json.dumps(API_KEY)};"
                     "document.getElementById('login-form').submit()")
    browser.wait_for("document.body && Number(document.body.dataset.updates) >= 1")
    assert browser.evaluate("location.pathname") == "/ps/dashboard"
    grids = browser.evaluate(GRID_STATES_JS)
    assert sorted(grids) == sorted(handle.workers)
    assert all(len(states) == NUM_DEVICE_BLOCKS for states in grids.values())

    # A small load until the page has shown blocks in use (or a deadline).
    stop = threading.Event()
    failures: list[BaseException] = []

    def load(index: int) -> None:
        count = 0
        while not stop.is_set():
            try:
                _complete(base_url, f"{SHARED_PREFIX} request {index}.{count}", 48, n=2 if index == 0 else 1)
            except BaseException as exc:
                failures.append(exc)
                return
            count += 1

    threads = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(4)]
    for thread in threads:
        thread.start()
    seen: list[dict[str, str]] = []
    tooltip = None
    try:
        # The loop ends as soon as it has seen enough; the long deadline is for a loaded machine
        # (CI at load 20+ once ran out of 60 s before a hover landed on a block still in use).
        deadline = time.time() + 180
        while time.time() < deadline and not failures:
            grids = browser.evaluate(GRID_STATES_JS)
            if not seen or grids != seen[-1]:
                seen.append(grids)
            busy = [(w, states.index("u")) for w, states in grids.items() if "u" in states]
            if busy and tooltip is None:
                worker_id, block = busy[0]
                ARTIFACTS.mkdir(exist_ok=True)
                browser.screenshot(ARTIFACTS / "dashboard.png")
                box = browser.evaluate(
                    f"(() => {{ const c = document.querySelector('.grid[data-worker=\"{worker_id}\"]"
                    f"[data-tier=\"device\"] .cell[data-i=\"{block}\"]'); c.scrollIntoView({{block: 'center'}});"
                    f" const r = c.getBoundingClientRect(); return [r.left, r.top, r.width]; }})()")
                x, y = box[0] + box[2] / 2, box[1] + box[2] / 2
                # Off the grid first: a move to where the pointer already is (the same block as a
                # missed try) may fire no mousemove, and the tooltip would never change.
                browser.call("Input.dispatchMouseEvent", type="mouseMoved", x=0, y=0)
                browser.call("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
                tooltip = browser.evaluate("document.getElementById('tooltip').hidden ? null : "
                                           "document.getElementById('tooltip').textContent")
                if tooltip is not None and ": in use" not in tooltip:
                    tooltip = None  # the page refreshed between reading and hovering: try again
                else:
                    browser.screenshot(ARTIFACTS / "dashboard-hover.png", full_page=False)
            if tooltip is not None and len(seen) >= 3:
                break
            time.sleep(0.25)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=120)
    assert not failures, failures
    assert any("u" in states or "s" in states for grids in seen for states in grids.values()), seen
    assert len(seen) >= 3, "the grids did not change as requests ran"
    assert tooltip is not None and ": in use" in tooltip and "owners: " in tooltip and "cmpl-" in tooltip, tooltip

    # Idle: the page settles on no block in use, and its numbers are /metrics' numbers.
    _wait_idle(handle)
    browser.wait_for(f"(() => {{ const g = {GRID_STATES_JS}; return Object.values(g).every(s => !/[usw]/.test(s)); }})()")
    metrics = _metrics(base_url)
    ttft_count = metrics[("pagedserve_time_to_first_token_seconds_count", (("model", "tiny-dash"),))]
    browser.wait_for(f"Number(document.querySelector('[data-metric=\"latency.ttft.count\"]').dataset.value) === {ttft_count}")
    grids = browser.evaluate(GRID_STATES_JS)
    for worker_id, states in grids.items():
        labels = (("pool", "device"), ("state", "cached"), ("worker", worker_id))
        assert states.count("c") == metrics[("pagedserve_kv_blocks", labels)]
        assert _metric_value(browser, f"{worker_id}.device_blocks_cached") == states.count("c")
        assert _metric_value(browser, f"{worker_id}.prefix_cache_hit_rate") == pytest.approx(
            metrics[("pagedserve_prefix_cache_hit_rate", (("worker", worker_id),))])
        assert _metric_value(browser, f"{worker_id}.num_running") == 0
        used = (("pool", "device"), ("state", "used"), ("worker", worker_id))
        assert _metric_value(browser, f"{worker_id}.device_blocks_used") == metrics[("pagedserve_kv_blocks", used)] == 0
        assert _metric_value(browser, f"{worker_id}.kv_utilization") == metrics[
            ("pagedserve_kv_slots_filled_ratio", (("worker", worker_id),))]
    assert browser.evaluate("document.querySelectorAll('#decision-table tbody tr').length") > 1
    browser.screenshot(ARTIFACTS / "dashboard-idle.png")

    # A small max_cells turns the grids into density maps.
    browser.navigate(page_url + "?max_cells=16")
    browser.wait_for("Number(document.body.dataset.updates) >= 1")
    assert browser.evaluate("document.querySelector('.grid[data-tier=\"device\"]').dataset.mode") == "density"
    assert browser.evaluate("document.querySelector('.grid[data-tier=\"device\"]').children.length") == 16
