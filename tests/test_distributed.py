"""The cluster on a multi-node Ray cluster (one machine): placement, greedy
equivalence with the single-process engine, cache-aware routing, KV events
through one relay per node, and a worker kill, a KV manager kill and a KV
relay kill mid-stream with nothing lost.

One ``ray.cluster_utils.Cluster`` per module: a head node (the KV manager)
plus two worker nodes that each declare one (fake) GPU, so the workers go
one per node and run on CPU. After every test the cluster must be idle with
consistent accounting and no block in use.
"""

from __future__ import annotations

import functools
import asyncio
import random
import signal
import time

import pytest

ray = pytest.importorskip("ray")

from pagedserve.workers.sample.sampling_params import SamplingParams  # noqa: E402
from polling import wait_for  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

NUM_WORKER_NODES = RAY_WORKER_NODES = 2
ENGINE = {"num_device_blocks": 128, "swap_space_gb": 0.001}
PROMPT_LENGTHS = [5, 17, 33, 48, 64, 90, 120, 150]
MAX_TOKENS = 14          # the equivalence test
MAX_TOKENS_FAULT = 48    # the kill tests: long enough to kill mid-stream
HELD_STREAMS_TIMEOUT_S = 120.0   # for a held handle's streams to make their first outputs


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _prompts(seed: int, lengths=PROMPT_LENGTHS, vocab: int = 1024) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


# ---- fixtures ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster_handle(ray_cluster, tiny_model):
    from pagedserve.cluster.bootstrap import start

    config = {
        "model": {"path": tiny_model("llama")},
        "engine": ENGINE,
        "workers": [{"count": NUM_WORKER_NODES, "num_gpus": 1, "num_cpus": 1}],
        "step_timeout_s": 20.0,
    }
    handle = start(config, ready_timeout_s=180.0)
    yield handle
    handle.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_model):
    """``reference(prompts, max_tokens, params=None) -> list[list[int]]`` from the single-process
    ``LLM``: greedy, or with ``params`` (seeded draws are reproducible)."""
    from pagedserve.workers.offline.llm import LLM

    llm = LLM(tiny_model("llama"), **ENGINE)
    cache: dict[tuple, list[int]] = {}

    def run(prompts: list[list[int]], max_tokens: int, params: SamplingParams | None = None) -> list[list[int]]:
        params = params or _greedy(max_tokens)
        missing = [p for p in prompts if (tuple(p), repr(params)) not in cache]
        if missing:
            for prompt, output in zip(missing, llm.generate(missing, params)):
                cache[(tuple(prompt), repr(params))] = list(output.outputs[0].token_ids)
        llm.check_integrity()
        return [cache[(tuple(p), repr(params))] for p in prompts]

    return run


@pytest.fixture
def handle(cluster_handle):
    """The shared cluster; after the test it must be idle, consistent and empty."""
    yield cluster_handle
    cluster_handle.wait_idle(timeout=120.0)
    cluster_handle.check_integrity()
    assert cluster_handle.num_used_blocks() == 0


# ---- helpers ----------------------------------------------------------------------------
def _token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


async def _stream_all(handle, prompts, params, kill, when):
    """Stream every prompt concurrently; call ``kill()`` once ``when(progress)`` holds
    (progress: request index -> tokens streamed so far). Returns final outputs
    and whether the kill happened while streams were still unfinished (under load one stream
    can finish before another's first tokens: the kill then lands on the others)."""
    progress = {i: 0 for i in range(len(prompts))}
    finished = {i: False for i in range(len(prompts))}
    fired = asyncio.Event()
    state = {"mid_stream": False}

    async def one(index, prompt):
        last = None
        async for output in handle.generate(prompt, params, request_id=f"fault-{index}-{time.time_ns()}"):
            last = output
            progress[index] = len(output.outputs[0].token_ids)
            finished[index] = output.finished
            if not fired.is_set() and when(progress):
                fired.set()
                state["mid_stream"] = not all(finished.values())
                kill()
        return last

    outputs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return outputs, fired.is_set() and state["mid_stream"]


def _assert_streams_survive(handle, prompts, params, expected, kill) -> None:
    """Stream every prompt and ``kill()`` once every stream is under way (two tokens or more,
    on both workers): each must still finish, at its length, with the ``expected`` tokens. The
    tests that kill a worker or its engine also check that some request was resumed."""
    outputs, mid_stream = asyncio.run(_stream_all(handle, prompts, params, kill,
                                                  lambda progress: all(n >= 2 for n in progress.values())))
    assert mid_stream, "the kill should land while streams are still running"
    assert all(o.finished for o in outputs)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    assert _token_ids(outputs) == expected


def _incarnation(kv_manager) -> str | None:
    """The KV manager's incarnation, or None while it is restarting."""
    from ray.exceptions import RayActorError

    try:
        return ray.get(kv_manager.get_incarnation.remote(), timeout=30)
    except RayActorError:  # ActorUnavailableError and ActorDiedError derive from it
        return None


_wait_for = functools.partial(wait_for, tolerate=(Exception,))   # an actor may be restarting


def _pid(actor) -> int:
    return ray.get(actor.heartbeat.remote(), timeout=30)["pid"]


# ---- tests ------------------------------------------------------------------------------
def test_placement_one_worker_per_node_and_kv_manager_on_head(handle, ray_cluster):
    head_id = ray_cluster.head_node.node_id
    infos = ray.get([w.info.remote() for w in handle.workers.values()], timeout=60)
    worker_nodes = [info["node_id"] for info in infos]
    assert all(info["device"] == "cpu" for info in infos)
    assert len(set(worker_nodes)) == NUM_WORKER_NODES, worker_nodes
    assert head_id not in worker_nodes
    assert ray.get(handle.kv_manager.node_id.remote(), timeout=60) == head_id
    assert sorted(ray.get(handle.kv_manager.worker_ids.remote(), timeout=60)) == sorted(handle.workers)


def _relay_endpoints(handle) -> dict[str, str]:
    """Worker id -> the endpoint its KV events go to."""
    stats = ray.get([w.stats.remote() for w in handle.workers.values()], timeout=60)
    return {w: s["kv_endpoint"] for w, s in zip(handle.workers, stats)}


def test_kv_events_go_through_one_relay_per_node_and_survive_a_relay_kill(handle, reference):
    from pagedserve.cluster.kv_relay import relay_name

    infos = ray.get([w.info.remote() for w in handle.workers.values()], timeout=60)
    relays = {info["worker_id"]: ray.get_actor(relay_name(info["node_id"]), namespace="pagedserve")
              for info in infos}
    endpoints = {w: ray.get(r.event_endpoint.remote(), timeout=60) for w, r in relays.items()}
    assert len(set(endpoints.values())) == NUM_WORKER_NODES          # one relay per node
    assert _relay_endpoints(handle) == endpoints                      # each worker publishes through its node's
    stats = ray.get(handle.kv_manager.stats.remote(), timeout=60)
    # Every message central received was a relay's bundle.
    assert stats["num_zmq_bundles"] > 0 and stats["num_zmq_messages"] == stats["num_zmq_bundles"]

    victim_id = sorted(relays)[0]
    prompts = _prompts(seed=9)
    expected = reference(prompts, MAX_TOKENS_FAULT)
    _assert_streams_survive(handle, prompts, _greedy(MAX_TOKENS_FAULT), expected,
                            lambda: ray.kill(relays[victim_id], no_restart=False))
    # Ray restarts the relay on a new port; its node's worker times out, resyncs and asks it again.
    _wait_for(lambda: ray.get(relays[victim_id].event_endpoint.remote(), timeout=30) != endpoints[victim_id],
              60, "the relay to restart")
    new_endpoint = ray.get(relays[victim_id].event_endpoint.remote(), timeout=30)
    _wait_for(lambda: _relay_endpoints(handle)[victim_id] == new_endpoint, 60,
              "the worker to reconnect to its restarted relay")
    # Nothing lost: central holds exactly what every worker caches (the fixture checks it too).
    _wait_for(lambda: handle.check_integrity() is None, 60, "the central index to match the workers")
    stats = ray.get(handle.kv_manager.stats.remote(), timeout=60)
    assert stats["num_zmq_messages"] == stats["num_zmq_bundles"]


def test_greedy_matches_single_process_engine(handle, reference):
    prompts = _prompts(seed=1)
    expected = reference(prompts, MAX_TOKENS)
    outputs = handle.generate_sync(prompts, _greedy(MAX_TOKENS))
    assert all(o.finished for o in outputs)
    assert _token_ids(outputs) == expected
    used = {d["worker_id"] for d in handle.stats()["recent_decisions"][-len(prompts):]}
    assert used == set(handle.workers), "the load should spread over every worker"


def _open_channels(handle) -> int:
    """Output channels open on the workers (``Worker.channels``)."""
    return sum(ray.get(worker.__ray_call__.remote(lambda w: len(w.channels)), timeout=30)
               for worker in handle.workers.values())


def test_a_handle_reads_each_worker_through_one_channel_closed_with_its_event_loop(handle, reference):
    """Streams running together on a worker come back in shared messages (fewer messages than
    outputs), each exact; the channels close with the event loop that read them, and a loop that
    ends mid-stream leaves nothing running on the workers."""
    prompts = _prompts(seed=12)

    async def stream_all(max_tokens: int, stop_after: int | None = None):
        outputs: dict[int, list] = {}

        async def one(index, prompt):
            async for output in handle.generate(None, _greedy(max_tokens), prompt_token_ids=prompt,
                                                is_streamed=True):
                outputs.setdefault(index, []).append(output)
                if stop_after is not None and len(outputs[index]) >= stop_after:
                    await asyncio.sleep(3600)  # the loop ends under it (asyncio.run cancels it)

        before = handle.channels.num_messages()
        submit_calls_before = handle.channels.num_submit_calls()
        tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(prompts)]
        if stop_after is None:
            await asyncio.gather(*tasks)
        else:
            while sum(len(v) >= stop_after for v in outputs.values()) < len(prompts):
                await asyncio.sleep(0.01)
        num_submit_calls = handle.channels.num_submit_calls() - submit_calls_before
        return outputs, handle.channels.num_messages() - before, num_submit_calls

    outputs, num_messages, num_submit_calls = asyncio.run(stream_all(MAX_TOKENS))
    assert [list(outputs[i][-1].outputs[0].token_ids) for i in range(len(prompts))] == reference(prompts, MAX_TOKENS)
    num_outputs = sum(len(v) for v in outputs.values())
    assert num_messages < num_outputs, (num_messages, num_outputs)
    # Started together, the requests went to their workers in a call per worker, not one each.
    # (Under load a request's routing can finish a turn after the others': it then goes in a
    # second call to its worker, once the first is answered.)
    assert num_submit_calls <= 2 * len(handle.workers) < len(prompts), (num_submit_calls, len(prompts))
    _wait_for(lambda: _open_channels(handle) == 0, 30, "the closed loop's channels to close on the workers")

    asyncio.run(stream_all(300, stop_after=2))  # every request still running when the loop ends
    _wait_for(lambda: _open_channels(handle) == 0, 30, "the channels to close")
    _wait_for(lambda: handle.num_used_blocks() == 0, 30, "the abandoned requests' blocks to come back")


def test_a_worker_sends_a_busy_handle_few_messages_ahead_and_merges_the_rest(handle, reference):
    """A handle whose event loop is held after each output (a replica at full load) reads its
    channels late: each worker sends at most ``MESSAGES_AHEAD`` messages ahead and merges what its
    requests make meanwhile, so a stream gets fewer outputs than tokens, each stream exact. (Without
    that bound, every engine step is a message of its own, queued for the handle to read in turn.)"""
    prompts = _prompts(seed=16)

    async def one(prompt):
        outputs = []
        async for output in handle.generate(None, _greedy(MAX_TOKENS_FAULT), prompt_token_ids=prompt,
                                            is_streamed=True):
            outputs.append(output)
            time.sleep(0.05)  # the loop held, as a busy replica's work holds it
        return outputs

    async def run():
        return await asyncio.gather(*(one(prompt) for prompt in prompts))

    results = asyncio.run(run())
    assert [list(r[-1].outputs[0].token_ids) for r in results] == reference(prompts, MAX_TOKENS_FAULT)
    num_outputs = [len(r) for r in results]
    assert sum(num_outputs) < len(prompts) * MAX_TOKENS_FAULT / 2, num_outputs

    async def held_then_dropped():  # the loop ends with every request running, the workers held back
        progress = [0] * len(prompts)

        async def one_of_many(index, prompt):
            async for _ in handle.generate(None, _greedy(300), prompt_token_ids=prompt, is_streamed=True):
                progress[index] += 1
                # Held long enough that the engine makes many steps between two reads, short enough
                # that every stream reads 3 outputs long before its 300 tokens end (at 50 ms a read,
                # eight streams read every 0.4 s, and one stream ended after 4 reads, another at 2).
                time.sleep(0.005)

        tasks = [asyncio.create_task(one_of_many(i, p)) for i, p in enumerate(prompts)]
        deadline = time.monotonic() + HELD_STREAMS_TIMEOUT_S
        while min(progress) < 3:
            for task in tasks:   # a stream that ended early says why, instead of the loop waiting on
                if task.done():
                    raise AssertionError(f"a stream ended after {progress} outputs") from task.exception()
            assert time.monotonic() < deadline, (f"streams stalled at {progress} outputs; "
                                                 f"{handle.num_used_blocks()} blocks in use")
            await asyncio.sleep(0.01)

    asyncio.run(held_then_dropped())
    _wait_for(lambda: _open_channels(handle) == 0, 30, "the held-back channels to close")
    _wait_for(lambda: handle.num_used_blocks() == 0, 30, "the abandoned requests' blocks to come back")


@pytest.mark.parametrize("transport", ["zmq", "ray"])
def test_streams_are_exact_over_either_output_transport(handle, reference, transport):
    """``output_transport``: a channel's messages over a socket (the default) or as Ray's streamed
    items; each stream ends with the single-process engine's tokens either way."""
    from pagedserve.cluster.worker_channels import WorkerChannels

    prompts = _prompts(seed=23)
    used, handle.channels = handle.channels, WorkerChannels(transport)

    async def one(prompt):
        async for output in handle.generate(None, _greedy(MAX_TOKENS_FAULT), prompt_token_ids=prompt,
                                            is_streamed=True):
            pass
        return list(output.outputs[0].token_ids)

    async def run():
        return await asyncio.gather(*(one(prompt) for prompt in prompts))

    try:
        assert asyncio.run(run()) == reference(prompts, MAX_TOKENS_FAULT)
        channels = list(handle.channels._channels.values())
        assert channels and all(channel.transport == transport for channel in channels)
        assert handle.channels.num_messages() > 0
    finally:
        handle.channels.close()
        handle.channels = used


def _frontend_class():
    """A handle in an async actor, as in a Serve replica, whose calls can be cancelled. Made
    here so that Ray ships the class by value (the workers cannot import the tests)."""

    class Frontend:
        def __init__(self, handle, renew_every_s: float | None = None, transport: str | None = None) -> None:
            import pagedserve.cluster.worker_channels as worker_channels

            if renew_every_s is not None:
                worker_channels.RENEW_EVERY_S = renew_every_s
            if transport is not None:
                handle.channels = worker_channels.WorkerChannels(transport)
            self.handle = handle
            self.progress: dict[int, int] = {}
            self.num_opened = 0

        async def open_channels(self) -> None:
            """Open this loop's channel to every worker from this call, then wait to be cancelled."""
            for worker_id, worker in self.handle.workers.items():
                self.handle.channels.get(worker_id, worker)
                self.num_opened += 1
            await asyncio.sleep(3600)

        def state(self) -> tuple[int, dict[int, int]]:
            return self.num_opened, dict(self.progress)

        async def run(self, index: int, prompt: list[int], max_tokens: int) -> list[int]:
            from pagedserve.workers.sample.sampling_params import SamplingParams

            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            last = None
            async for output in self.handle.generate(None, params, prompt_token_ids=prompt):
                last = output
                self.progress[index] = len(output.outputs[0].token_ids)
            return list(last.outputs[0].token_ids)

    return ray.remote(num_cpus=0)(Frontend)


def _signal_engine_cores(handle, signum: int) -> None:
    """Send ``signum`` to every worker's engine core process."""
    def send(worker):
        import os

        os.kill(worker.core.pid, signum)

    ray.get([worker.__ray_call__.remote(send) for worker in handle.workers.values()], timeout=30)


def test_cancelling_the_call_that_opened_a_channel_ends_no_other_request(handle, reference):
    """Ray cancels what a cancelled actor call started (Serve cancels a request whose client
    went away): the channels a request opened must outlive it, or every request reading them
    would end with TaskCancelledError."""
    prompts = _prompts(seed=13)
    frontend = _frontend_class().remote(handle)
    opener = frontend.open_channels.remote()
    _wait_for(lambda: ray.get(frontend.state.remote(), timeout=30)[0] == len(handle.workers), 60,
              "the channels to open")
    max_tokens = 300  # still running when the cancel lands
    runs = [frontend.run.remote(i, p, max_tokens) for i, p in enumerate(prompts)]
    _wait_for(lambda: (lambda progress: len(progress) == len(prompts) and min(progress.values()) >= 2)(
        ray.get(frontend.state.remote(), timeout=30)[1]), 120, "every request to stream")
    # The engine cores hold still while the cancel lands, so that it lands mid-stream however
    # long it takes on a loaded machine.
    _signal_engine_cores(handle, signal.SIGSTOP)
    try:
        ray.cancel(opener)
        with pytest.raises(ray.exceptions.TaskCancelledError):
            ray.get(opener, timeout=60)
        progress_at_cancel = ray.get(frontend.state.remote(), timeout=30)[1]
    finally:
        _signal_engine_cores(handle, signal.SIGCONT)
    assert ray.get(runs, timeout=300) == reference(prompts, max_tokens)
    assert max(progress_at_cancel.values()) < max_tokens, "the requests should still run when the cancel lands"
    ray.kill(frontend)


def _set_channel_lease(handle, lease_s: float) -> None:
    def set_lease(worker):
        worker.channel_lease_s = lease_s

    ray.get([worker.__ray_call__.remote(set_lease) for worker in handle.workers.values()], timeout=30)


@pytest.mark.parametrize("transport", ["zmq", "ray"])
def test_a_dead_handles_channels_close_and_free_their_requests(handle, transport):
    """A Serve replica that crashed: over a socket its channels close as soon as its connections
    do, well within their lease; over Ray's streamed items (Ray does not end a streamed call
    whose caller's process died) once their lease runs out. Either way what ran on them is
    aborted."""
    from pagedserve.workers.actor.output_channel import CHANNEL_LEASE_S

    prompts = _prompts(seed=14)
    # For the channels opened from now on: over Ray, a short lease ends them; over a socket, a
    # long one, so that a close within half of it is the connection's doing even on a loaded
    # machine.
    lease_s = 3.0 if transport == "ray" else 4 * CHANNEL_LEASE_S
    _set_channel_lease(handle, lease_s)
    try:
        frontend = _frontend_class().remote(handle, renew_every_s=0.5, transport=transport)
        runs = [frontend.run.remote(i, p, 300) for i, p in enumerate(prompts)]
        _wait_for(lambda: (lambda progress: len(progress) == len(prompts) and min(progress.values()) >= 2)(
            ray.get(frontend.state.remote(), timeout=30)[1]), 120, "every request to stream")
        ray.kill(frontend)
        del runs
        assert _open_channels(handle) > 0
        _wait_for(lambda: _open_channels(handle) == 0, lease_s / 2 if transport == "zmq" else 60,
                  "the dead handle's channels to close")
        _wait_for(lambda: handle.num_used_blocks() == 0, 60, "its requests' blocks to come back")
    finally:
        _set_channel_lease(handle, CHANNEL_LEASE_S)


def test_a_request_whose_worker_sends_nothing_for_the_timeout_goes_on_elsewhere(handle, reference):
    """``server.limits.request_timeout_s`` bounds the wait for each output through a channel: a
    worker whose engine is held longer sends nothing, and its requests resume on the other."""
    prompts = _prompts(seed=15)
    limits = handle.config.server.limits
    timeout_before, counters_before = limits.request_timeout_s, handle.request_counters()
    victim = handle.workers["worker-0"]

    def hold_the_engine(worker):  # runs in the worker: its engine core process stops for 6 s
        import os
        import signal
        import threading

        os.kill(worker.core.pid, signal.SIGSTOP)
        threading.Timer(6.0, os.kill, (worker.core.pid, signal.SIGCONT)).start()

    limits.request_timeout_s = 1.5
    try:
        async def run():
            await asyncio.get_running_loop().run_in_executor(
                None, lambda: ray.get(victim.__ray_call__.remote(hold_the_engine), timeout=30))
            return await asyncio.gather(*(_last(handle.generate(None, _greedy(MAX_TOKENS), prompt_token_ids=p))
                                          for p in prompts))

        outputs = asyncio.run(run())
    finally:
        limits.request_timeout_s = timeout_before
    assert _token_ids(outputs) == reference(prompts, MAX_TOKENS)
    assert handle.request_counters()["num_resumed"] > counters_before["num_resumed"]


async def _last(outputs):
    last = None
    async for output in outputs:
        last = output
    return last


def test_repeated_prefix_goes_to_the_worker_that_holds_it(handle, reference):
    rng = random.Random(2)
    prefix = [rng.randrange(3, 1024) for _ in range(96)]   # six full blocks of 16
    prompts = [prefix + [rng.randrange(3, 1024) for _ in range(5 + i)] for i in range(4)]
    expected = reference(prompts, MAX_TOKENS)

    first = handle.generate_sync(prompts[:1], _greedy(MAX_TOKENS))
    owner = handle.stats()["recent_decisions"][-1]["worker_id"]
    outputs = list(first)
    for prompt in prompts[1:]:   # one at a time, so load never outweighs the cached prefix
        # The central index learns of blocks by events, a flush interval (50 ms) later.
        _wait_for(lambda: ray.get(handle.kv_manager.longest_prefix.remote(prompt), timeout=30).get(owner, 0)
                  >= len(prefix), 5, "the owner's blocks to reach the central index")
        outputs += handle.generate_sync([prompt], _greedy(MAX_TOKENS))
        decision = handle.stats()["recent_decisions"][-1]
        assert decision["worker_id"] == owner, decision
        assert decision["reason"] == "prefix", decision
        assert decision["cached_tokens"] == len(prefix), decision
    assert _token_ids(outputs) == expected
    kv_stats = handle.stats()["kv_manager"]["workers"][owner]
    assert kv_stats["num_prefix_hit_tokens"] >= 3 * len(prefix)


def test_a_salted_prefix_is_found_and_routed_to_only_under_its_salt(handle, reference):
    """cache_salt through the cluster: the worker's blocks carry the salt into the central index,
    which finds them for the same salt only; the handle asks under the request's salt, so a
    repeat goes to the worker holding its salted prefix."""
    rng = random.Random("salted prefix")   # tokens no other test sends, salted or not
    prefix = [rng.randrange(3, 1024) for _ in range(96)]   # six full blocks of 16
    prompts = [prefix + [rng.randrange(3, 1024) for _ in range(3 + i)] for i in range(2)]
    salted = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, cache_salt="tenant-7")
    outputs = handle.generate_sync(prompts[:1], salted)
    owner = handle.stats()["recent_decisions"][-1]["worker_id"]

    def index(salt):
        return ray.get(handle.kv_manager.longest_prefix.remote(prompts[1], salt), timeout=30)

    _wait_for(lambda: index("tenant-7").get(owner, 0) >= len(prefix), 5,
              "the owner's salted blocks to reach the central index")
    assert max(index("tenant-8").values(), default=0) == 0 and max(index(None).values(), default=0) == 0
    outputs += handle.generate_sync(prompts[1:], salted)
    decision = handle.stats()["recent_decisions"][-1]
    assert decision["worker_id"] == owner and decision["reason"] == "prefix", decision
    assert decision["cached_tokens"] == len(prefix), decision
    assert _token_ids(outputs) == reference(prompts, MAX_TOKENS)


def test_worker_killed_mid_stream_requests_resume_and_worker_rejoins(handle, reference):
    """The requests sample with a seed: a resumed run takes the streamed tokens as its own
    outputs, so its seeded draws (a hash of the seed and the output position) go on exactly."""
    prompts = _prompts(seed=3)
    params = SamplingParams(temperature=1.0, seed=40, max_tokens=MAX_TOKENS_FAULT, ignore_eos=True)
    expected = reference(prompts, MAX_TOKENS_FAULT, params)
    num_resumed_before = handle.stats()["num_resumed"]
    victim_id = "worker-0"
    victim = handle.workers[victim_id]
    victim_pid = _pid(victim)

    def kill():
        ray.kill(victim, no_restart=False)

    _assert_streams_survive(handle, prompts, params, expected, kill)
    assert handle.stats()["num_resumed"] > num_resumed_before

    # Ray restarts the worker; it answers again and its accounting is fresh.
    _wait_for(lambda: ray.get(victim.info.remote(), timeout=30)["worker_id"] == victim_id, 120,
              "the killed worker to restart")
    assert _pid(victim) != victim_pid, "Ray should have restarted the worker in a new process"
    handle.wait_healthy(timeout=60)  # the handle's heartbeat monitor puts it back in rotation
    kv_workers = ray.get(handle.kv_manager.stats.remote(), timeout=30)["workers"]
    assert victim_id in kv_workers
    assert kv_workers[victim_id]["device_blocks_used"] == 0

    # It rejoins: new requests run on it again.
    prompts = _prompts(seed=4, lengths=[8, 24, 40, 56])
    outputs = handle.generate_sync(prompts, _greedy(MAX_TOKENS))
    assert _token_ids(outputs) == reference(prompts, MAX_TOKENS)
    used = {d["worker_id"] for d in handle.stats()["recent_decisions"][-len(prompts):]}
    assert victim_id in used


def test_a_streamed_request_with_several_samples_ends_when_its_worker_dies(handle):
    """Several samples cannot resume one by one, and a caller that streams already has the failed
    run's tokens: the request ends with ``StreamNotResumable`` (the server's error event), not a
    second run from the prompt that the client would get appended to the first."""
    from pagedserve.cluster.request_flow import StreamNotResumable

    params = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=MAX_TOKENS_FAULT, ignore_eos=True)
    request_id = f"streamed-n2-{time.time_ns()}"
    counters_before = handle.request_counters()

    async def stream() -> tuple[list, str | None, BaseException | None]:
        outputs, victim = [], None
        try:
            async for output in handle.generate(_prompts(seed=9)[3], params, request_id=request_id,
                                                is_streamed=True):
                outputs.append(output)
                if victim is None and all(len(c.token_ids) >= 2 for c in output.outputs):
                    victim = next(d["worker_id"] for d in reversed(handle.router.recent_decisions())
                                  if d["request_id"] == request_id)
                    ray.kill(handle.workers[victim], no_restart=False)
        except StreamNotResumable as exc:
            return outputs, victim, exc
        return outputs, victim, None

    outputs, victim, error = asyncio.run(stream())
    assert victim is not None, "the kill should land mid-stream"
    assert error is not None, ("the stream went on from the prompt after its worker died: "
                               f"{[len(c.token_ids) for c in outputs[-1].outputs]} tokens, "
                               f"finished: {outputs[-1].finished}")
    assert "2 samples cannot be continued" in str(error)
    counters = handle.request_counters()
    assert counters["num_not_resumable"] == counters_before["num_not_resumable"] + 1
    assert counters["num_resumed"] == counters_before["num_resumed"]
    _wait_for(lambda: ray.get(handle.workers[victim].info.remote(), timeout=30)["worker_id"] == victim, 120,
              "the killed worker to restart")
    handle.wait_healthy(timeout=60)


def test_a_failed_engine_loop_hands_its_requests_on_and_its_worker_restarts(handle, reference):
    """A worker whose engine loop fails (a bug, a device fault) lives on, but every request it held
    ends with EngineDeadError: each goes on elsewhere after its streamed tokens, exactly (seeded
    draws), and the controller restarts the worker, whose heartbeat now says it is stalled."""
    prompts = _prompts(seed=6)
    params = SamplingParams(temperature=1.0, seed=41, max_tokens=MAX_TOKENS_FAULT, ignore_eos=True)
    expected = reference(prompts, MAX_TOKENS_FAULT, params)
    counters_before = handle.request_counters()
    victim_id = "worker-0"
    victim = handle.workers[victim_id]
    victim_pid = _pid(victim)

    def fail_the_engine():   # runs in the worker: its engine core's next step raises
        victim.__ray_call__.remote(lambda worker: worker.core.call("inject_failure", "the engine step failed"))

    _assert_streams_survive(handle, prompts, params, expected, fail_the_engine)
    counters = handle.request_counters()
    assert counters["num_resumed"] > counters_before["num_resumed"]
    assert counters["num_repeated_engine_failures"] == counters_before["num_repeated_engine_failures"]

    _wait_for(lambda: _pid(victim) != victim_pid, 120, "the controller to restart the worker")
    handle.wait_healthy(timeout=60)
    prompts = _prompts(seed=8, lengths=[8, 24, 40, 56])
    assert _token_ids(handle.generate_sync(prompts, _greedy(MAX_TOKENS))) == reference(prompts, MAX_TOKENS)


def test_a_killed_engine_core_hands_its_requests_on_and_its_worker_restarts(handle, reference):
    """A worker's engine core process killed mid-stream (SIGKILL: the OOM killer, a driver
    crash) is a dead engine: its requests go on elsewhere exactly, and the worker restarts."""
    prompts = _prompts(seed=7)
    params = SamplingParams(temperature=1.0, seed=43, max_tokens=MAX_TOKENS_FAULT, ignore_eos=True)
    expected = reference(prompts, MAX_TOKENS_FAULT, params)
    counters_before = handle.request_counters()
    victim = handle.workers["worker-1"]
    victim_pid = _pid(victim)

    def kill_the_core():
        victim.__ray_call__.remote(lambda worker: __import__("os").kill(worker.core.pid, 9))

    _assert_streams_survive(handle, prompts, params, expected, kill_the_core)
    assert handle.request_counters()["num_resumed"] > counters_before["num_resumed"]
    _wait_for(lambda: _pid(victim) != victim_pid, 120, "the controller to restart the worker")
    handle.wait_healthy(timeout=60)
    prompts = _prompts(seed=9, lengths=[8, 24, 40, 56])
    assert _token_ids(handle.generate_sync(prompts, _greedy(MAX_TOKENS))) == reference(prompts, MAX_TOKENS)


def test_kv_manager_killed_mid_stream_requests_complete(handle, reference):
    prompts = _prompts(seed=5)
    expected = reference(prompts, MAX_TOKENS_FAULT)
    params = _greedy(MAX_TOKENS_FAULT)
    kv_manager = handle.kv_manager
    incarnation = ray.get(kv_manager.get_incarnation.remote(), timeout=30)

    def kill():
        ray.kill(kv_manager, no_restart=False)

    _assert_streams_survive(handle, prompts, params, expected, kill)
    # The streams need not wait for the restart: workers plan locally and keep serving.
    _wait_for(lambda: _incarnation(kv_manager) not in (None, incarnation), 60, "the KV manager to restart")
    # The restarted manager was rebuilt from the workers' snapshots (they resync by themselves).
    _wait_for(lambda: ray.get(kv_manager.stats.remote(), timeout=30)["num_snapshots"] >= len(handle.workers),
              30, "every worker to resync with the new KV manager")

    # Both workers serve again (an idle one re-registers at its first step).
    prompts = _prompts(seed=6, lengths=[8, 24, 40, 56])
    outputs = handle.generate_sync(prompts, _greedy(MAX_TOKENS))
    assert _token_ids(outputs) == reference(prompts, MAX_TOKENS)
    used = {d["worker_id"] for d in handle.stats()["recent_decisions"][-len(prompts):]}
    assert used == set(handle.workers)
    # Each worker reconnects by itself (a failed endpoint ask is repeated every 0.25 s).
    _wait_for(lambda: sorted(ray.get(kv_manager.worker_ids.remote(), timeout=30)) == sorted(handle.workers),
              30, "every worker to be indexed by the restarted KV manager")


def test_kv_manager_restart_while_idle_keeps_every_worker_in_rotation(handle, reference):
    kv_manager = handle.kv_manager
    incarnation = ray.get(kv_manager.get_incarnation.remote(), timeout=30)
    ray.kill(kv_manager, no_restart=False)
    _wait_for(lambda: _incarnation(kv_manager) not in (None, incarnation), 60, "the KV manager to restart")
    # Idle workers have not re-registered yet; they must stay in rotation even when
    # the first request after the restart reaches only one of them.
    for lengths in ([8], [8, 24, 40, 56], [10, 26, 42, 58]):
        prompts = _prompts(seed=7, lengths=lengths)
        outputs = handle.generate_sync(prompts, _greedy(MAX_TOKENS))
        assert _token_ids(outputs) == reference(prompts, MAX_TOKENS)
        time.sleep(0.6)  # past the router's utilisation refresh interval
    used = {d["worker_id"] for d in handle.stats()["recent_decisions"][-4:]}
    assert used == set(handle.workers)
