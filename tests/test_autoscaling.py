"""Elastic workers on a real autoscaling Ray cluster (Ray's fake multi-node provider).

The head has no GPU; a worker node type offers {CPU: 1, GPU: 1}, 0 to 3 of them. A
pagedserve group with ``autoscaling: {min_replicas: 1, max_replicas: 3}`` follows
streaming load from the official ``openai`` client: worker actors waiting for a GPU
make Ray's autoscaler add nodes, and the new workers join routing once ready. When the
load falls while long streams still run, the group shrinks to one worker: the surplus
workers drain, handing their running sequences over through KV migration. The long
streams are held mid-flight through the scale-down: from when they have started until
the group has shrunk, every worker's engine pauses after each step (``Pacer``), so they
cannot finish before the drain, however fast the machine.

Asserted: no request fails; every greedy output equals the same request served alone
(a stream closed early is a prefix of it); at least one drained sequence moved by
migration; the KV manager's integrity holds and no block is in use at the end.
"""

from __future__ import annotations

import functools
import threading

import pytest
import yaml

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

from fake_cluster import SERVE_FILE, FakeAutoscalingCluster  # noqa: E402
from served_cluster import free_port  # noqa: E402

from pagedserve.workers.actor.worker import FAULT_INJECTION_ENV  # noqa: E402
from polling import wait_for  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(900)]

FILLER_TOKENS = 48
LONG_TOKENS = 490
# While paced, each engine step is followed by this pause: a long stream (485+ tokens left
# when pacing starts) would need over 8 minutes to finish, past every wait below.
PACE_STALL_S = 1.0


@pytest.fixture(scope="module")
def elastic(tmp_path_factory, tiny_model):
    from ray import serve

    from pagedserve.cluster.bootstrap import NAMESPACE, start
    from pagedserve.cluster.config import ClusterConfig
    from pagedserve.cluster.serving.deployment import deploy

    if ray.is_initialized():
        ray.shutdown()
    cluster = FakeAutoscalingCluster(tmp_path_factory.mktemp("fake-cluster")).start()
    handle = None
    try:
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False,
                 runtime_env={"env_vars": {FAULT_INJECTION_ENV: "1"}})  # for Pacer
        data = yaml.safe_load(SERVE_FILE.read_text())
        data["model"] = {"path": tiny_model("llama")}
        data["server"] = {"port": free_port(), "num_replicas": 1}   # the workers scale here, not the ingress
        data["workers"][0]["autoscaling"]["downscale_delay_s"] = 1  # shrink while the long streams run
        config = ClusterConfig.model_validate(data)
        handle = start(config, ready_timeout_s=300.0)
        endpoints = deploy(handle, config, quiet=True)
        yield handle, endpoints["http"]
    finally:
        try:
            serve.shutdown()
        except Exception:
            pass
        if handle is not None:
            handle.shutdown()
        ray.shutdown()
        cluster.stop()


def _pool_status(handle) -> dict:
    return handle.worker_states()


_wait_for = functools.partial(wait_for, interval_s=0.5)


class Load:
    """Client threads streaming completions; every stream's text is kept by prompt."""

    def __init__(self, base_url: str, model: str) -> None:
        self.model = model
        self.client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
        self.results: list[tuple[str, int, str, bool]] = []  # prompt, max_tokens, text, finished
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def stream(self, prompt: str, max_tokens: int, close_after: int | None = None,
               on_token=None) -> None:
        try:
            stream = self.client.completions.create(
                model=self.model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                stream=True, extra_body={"ignore_eos": True})
            text, finished, num_chunks = "", False, 0
            for chunk in stream:
                text += chunk.choices[0].text if chunk.choices else ""
                finished = finished or bool(chunk.choices and chunk.choices[0].finish_reason)
                num_chunks += 1
                if on_token is not None:
                    on_token(num_chunks)
                if close_after is not None and (num_chunks >= close_after or self.stop.is_set()):
                    stream.close()  # the client hangs up mid-stream
                    break
            with self._lock:
                self.results.append((prompt, max_tokens, text, finished))
        except Exception as exc:
            with self._lock:
                self.failures.append(f"{prompt!r}: {exc!r}")

    def start_fillers(self, num_clients: int) -> None:
        def run(index: int) -> None:
            round_ = 0
            while not self.stop.is_set():
                # Every third request is closed early (or as soon as the load stops).
                close_after = 8 if round_ % 3 == 2 else FILLER_TOKENS + 10
                self.stream(f"filler {index} round {round_ % 4}:", FILLER_TOKENS, close_after)
                round_ += 1

        for index in range(num_clients):
            thread = threading.Thread(target=run, args=(index,), daemon=True)
            thread.start()
            self.threads.append(thread)

    def start_long(self, prompt: str, progress: dict) -> threading.Thread:
        def note(num_chunks: int) -> None:
            progress[prompt] = num_chunks

        thread = threading.Thread(target=self.stream, args=(prompt, LONG_TOKENS, None, note), daemon=True)
        thread.start()
        return thread


class Pacer:
    """Slows every live worker's engine to about one step per ``PACE_STALL_S``: a thread
    re-arms ``Worker.inject_stall`` on each ready or draining worker four times per pause,
    so each step is followed by one. Requests, aborts, drains and migrations all still go
    on, one step at a time."""

    def __init__(self, handle) -> None:
        self.handle = handle
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.num_rounds = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Pacer":
        self.thread.start()
        return self

    def __exit__(self, exc_type, *_) -> None:
        self.stop.set()
        self.thread.join(timeout=60)
        if exc_type is None:
            assert not self.errors, self.errors

    def _run(self) -> None:
        from ray.exceptions import RayActorError

        from pagedserve.cluster.bootstrap import NAMESPACE
        from pagedserve.cluster.worker_pool import worker_actor_name

        while not self.stop.is_set():
            try:
                workers = self.handle.worker_states()["workers"]
                live = [w for w, r in workers.items() if r["state"] in ("ready", "draining")]
                refs = []
                for worker_id in live:
                    index = int(worker_id.rsplit("-", 1)[1])
                    try:
                        actor = ray.get_actor(worker_actor_name(index), namespace=NAMESPACE)
                    except ValueError:
                        continue  # drained and gone meanwhile
                    refs.append(actor.inject_stall.remote(PACE_STALL_S))
                for ref in refs:
                    try:
                        ray.get(ref, timeout=30)
                    except RayActorError:
                        pass  # drained and gone meanwhile
                self.num_rounds += 1
            except Exception as exc:  # fault injection off, a controller that does not answer
                self.errors.append(repr(exc))
                return
            self.stop.wait(PACE_STALL_S / 4)


def test_workers_follow_load_and_drain_through_migration(elastic):
    handle, base_url = elastic
    assert _pool_status(handle)["counts"]["ready"] == 1
    load = Load(base_url, handle.model_name)
    load.start_fillers(8)
    # Demand for 3 workers: Ray's autoscaler adds fake GPU nodes for the waiting actors.
    _wait_for(lambda: _pool_status(handle)["counts"]["ready"] >= 2, 240, "a second worker to become ready",
              lambda: _pool_status(handle))

    def used_workers() -> set[str]:
        workers = handle.stats()["workers"]
        return {w for w, s in workers.items() if s.get("num_generated_tokens", 0) > 0}

    def ready_and_used() -> set[str] | None:
        ready = {w for w, r in _pool_status(handle)["workers"].items() if r["state"] == "ready"}
        used = used_workers()
        return used if len(used) >= 2 and ready <= used else None

    # Every ready worker carries filler load before the long streams start, so that least-loaded
    # routing spreads them rather than sending all three to a worker that has just become ready
    # (it would then keep them all, and the drained workers would hold none).
    used = _wait_for(ready_and_used, 120, "routing to use a second worker, and every ready one",
                     lambda: (_pool_status(handle), used_workers()))
    assert len(used) >= 2
    num_ready_peak = _pool_status(handle)["counts"]["ready"]

    # Long streams, then the load falls: closing filler streams mid-stream as it stops.
    progress: dict[str, int] = {}
    longs = [load.start_long(f"long stream {i}:", progress) for i in range(3)]
    _wait_for(lambda: len(progress) == 3 and min(progress.values()) >= 5, 120, "the long streams to start")
    with Pacer(handle) as pacer:  # the long streams stay mid-flight until the group has shrunk
        load.stop.set()
        for thread in load.threads:
            thread.join(timeout=120)
        # 3 ongoing long streams at target 3 per worker want one worker: the surplus drains.
        _wait_for(lambda: (lambda c: c["ready"] == 1 and c["draining"] == 0 and c["starting"] == 0)(
            _pool_status(handle)["counts"]), 240, "the group to shrink to one worker",
            lambda: _pool_status(handle))
        assert all(not thread.is_alive() for thread in load.threads)
        assert all(thread.is_alive() for thread in longs), (
            f"a long stream finished before the drain (progress {progress}, failures {load.failures}, "
            f"pacer errors {pacer.errors})")
        progress_at_shrink = sorted(progress.values())
    assert pacer.num_rounds > 0
    for thread in longs:
        thread.join(timeout=300)

    status = _pool_status(handle)
    drained = [r for r in status["workers"].values() if r["reason"] == "drained"]
    assert drained, status
    num_moved = sum(r["num_drain_migrations"] for r in drained)
    assert num_moved >= 1, "a drained worker should have handed a running sequence over"
    assert load.failures == []

    # Every output equals the same request served alone (on the one remaining worker).
    solo = Load(base_url, handle.model_name)
    for prompt, max_tokens in sorted({(p, m) for p, m, _, _ in load.results}):
        solo.stream(prompt, max_tokens)
    assert solo.failures == []
    alone = {(p, m): text for p, m, text, _ in solo.results}
    num_checked = 0
    for prompt, max_tokens, text, finished in load.results:
        if finished:
            assert text == alone[(prompt, max_tokens)], prompt
        else:
            assert alone[(prompt, max_tokens)].startswith(text), prompt
        num_checked += 1
    assert num_checked >= 3 + 8
    assert sum(1 for p, m, _, f in load.results if m == LONG_TOKENS and f) == 3

    handle.wait_idle(timeout=60)
    handle.check_integrity()
    assert handle.num_used_blocks() == 0
    print(f"\nelastic: peak {num_ready_peak} ready workers, {len(drained)} drained, "
          f"{num_moved} sequences moved by migration, {len(load.results)} streams, 0 failed; "
          f"long streams at {progress_at_shrink} of {LONG_TOKENS} chunks when the group had shrunk")
