"""A worker's engine core in its own process, driven as the worker actor drives it, without Ray.

``EngineCoreClient`` starts a real core process (the tiny Llama on the CPU) with a central KV
manager in this process behind its transport (``InProcessTransport``):

- each step's rows come as one packed batch per output channel, and rebuild exactly the
  tokens the offline engine makes; a channel of the socket transport gets them from the core
  itself, and one whose reader leaves has its requests aborted;
- closing a channel aborts its requests and nothing else; a refused request ends alone, with
  its error; utility calls answer between steps; KV events reach the central manager;
- an engine that fails, or a core process that is killed, is reported dead once, with its
  engine's id, and every call still waiting fails; a core never outlives its parent, even a
  parent killed with SIGKILL;
- the actor's ``OutputChannel`` stays open while renewed and closes on its lease.

Every test ends with the core's pools consistent and no block in use. Tests that leave their
core as it was share one (``core``), as a worker's core serves one request after another;
those that fail or kill it start their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.kvmanager import InProcessTransport
from pagedserve.kvmanager.service import KVManagerService
from pagedserve.workers.actor.core_client import CoreDead, EngineCoreClient
from pagedserve.workers.actor.output_channel import OutputChannel
from pagedserve.workers.actor.protocol import EngineDeadError, OutputDelta, deltas_from_batch
from pagedserve.workers.engine.core_messages import AddRequest
from pagedserve.workers.engine.core_process import CoreSpec
from pagedserve.workers.outputs.accumulator import OutputAccumulator
from pagedserve.workers.outputs.channel_socket import BATCH, DEAD, END, ChannelSocketReceiver, decode
from pagedserve.workers.outputs.stream_batch import StreamBatch

PROMPTS = [list(range(3, 3 + n)) for n in (5, 17, 30, 9)]
ENGINE = {"device": "cpu", "dtype": "float32", "block_size": 8, "num_device_blocks": 96, "swap_space_gb": 0.001}


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


class Core:
    """A started core and what it sent: each channel's deltas by key, in order, and deaths.

    The client delivers them on an event loop of the helper's own (as on the actor's, one for
    the core's life), so that tests, each with its loop, may share the core."""

    def __init__(self, model: str, worker_id: str = "w0", **engine) -> None:
        self.service = KVManagerService()
        self.items: dict[str, list] = {}
        self.deaths: list[tuple[str, str | None]] = []
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="core-news", daemon=True).start()
        spec = CoreSpec(worker_id, {"model": model, **ENGINE, **engine})
        self.client = EngineCoreClient(spec, InProcessTransport(self.service), self._on_items, self._on_dead)
        self.client.bind_loop(self.loop)
        self.info = self.client.start(timeout_s=120)

    def _on_items(self, items: list) -> None:
        for item in items:
            self.items.setdefault(item[1], []).append(item)

    def _on_dead(self, message: str, engine_id: str | None) -> None:
        self.deaths.append((message, engine_id))

    def forget(self) -> None:
        """Forget what the core sent so far (a test that shares it starts afresh)."""
        self.items.clear()
        self.deaths.clear()

    def add(self, channel: str, key: int, prompt: list[int], params: SamplingParams) -> None:
        self.client.add(AddRequest(channel, key, f"{channel}/{key}", prompt, params))

    async def open_socket(self, channel: str) -> ChannelSocketReceiver:
        """Open ``channel`` as a socket channel in the core (as ``Worker.channel_outputs`` does)
        and connect a reader to it, as a handle does."""
        address = await asyncio.wrap_future(self.client.call("open_output_socket", channel, 2, "127.0.0.1"))
        return ChannelSocketReceiver(address, channel)

    def deltas(self, channel: str) -> dict[int, list]:
        """The channel's deltas (and errors) by key, from the batches that came so far."""
        by_key: dict[int, list] = {}
        for item in self.items.get(channel, []):
            if item[0] == "outputs":
                for key, delta in deltas_from_batch(StreamBatch.unpack(item[2])):
                    by_key.setdefault(key, []).append(delta)
        return by_key

    async def wait_for(self, done, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.01)

    def check(self) -> None:
        """The core's pools are consistent and, once what ends has ended, no block is in use."""
        self.client.call("check_integrity").result(30)
        deadline = time.monotonic() + 30
        while self.client.call("num_used_blocks").result(30) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.client.call("num_used_blocks").result(30) == 0

    def check_and_close(self) -> None:
        try:
            if self.client.is_running:
                self.check()
        finally:
            self.client.shutdown()
            self.loop.call_soon_threadsafe(self.loop.stop)


def _ended(deltas: list) -> bool:
    return bool(deltas) and (isinstance(deltas[-1], BaseException) or deltas[-1].finished)


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def expected(model) -> list[list[int]]:
    llm = LLM(model=model, **ENGINE)
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, _greedy(16), use_tqdm=False)]


@pytest.fixture(scope="module")
def shared_core(model):
    started = Core(model)
    yield started
    started.check_and_close()


@pytest.fixture
def core(shared_core):
    """The module's core, for a test that leaves it serving; checked after the test."""
    shared_core.forget()
    yield shared_core
    assert shared_core.client.is_running and not shared_core.deaths, "a test broke the shared core"
    shared_core.check()


@pytest.fixture
def own_core(model):
    """A core of the test's own, for a test that fails or kills it."""
    started = Core(model)
    yield started
    started.check_and_close()


def test_each_channel_gets_one_batch_per_step_and_its_rows_rebuild_the_engines_tokens(core, expected):
    generated_before = core.client.call("stats").result(30)["engine"]["num_generated_tokens"]

    async def run():
        for key, prompt in enumerate(PROMPTS):
            core.add(f"channel-{key % 2}", key, prompt, _greedy(16))
        await core.wait_for(lambda: all(_ended(core.deltas(f"channel-{k % 2}").get(k, [])) for k in range(4)))

    asyncio.run(run())
    for key, prompt in enumerate(PROMPTS):
        deltas = core.deltas(f"channel-{key % 2}")[key]
        assert all(type(d) is OutputDelta for d in deltas)
        accumulator = OutputAccumulator(str(key), None, prompt)
        final = [accumulator.add(d) for d in deltas][-1]
        assert final.finished and final.outputs[0].token_ids == expected[key]
        assert final.metrics.num_generated_tokens == 16
    for channel in ("channel-0", "channel-1"):
        batches = [item for item in core.items[channel] if item[0] == "outputs"]
        assert 16 <= len(batches) <= 20   # one per step: its two requests share each
    # KV events reached the central manager: its index holds what the core's pool caches.
    snapshot = core.client.call("kv_sync", 10.0).result(30)
    assert snapshot is not None
    core.service.check_consistency([snapshot])
    stats = core.client.call("stats").result(30)
    assert stats["engine"]["num_generated_tokens"] - generated_before == 64
    assert stats["kv_link"]["num_event_batches"] >= 1


async def _read_socket(receiver: ChannelSocketReceiver, by_key: dict[int, list], until) -> list:
    """Read a socket channel's messages as a handle does (a credit for each), its batches' deltas
    by key, until ``until(by_key)`` or the channel's end; the message kinds read, in order."""
    kinds = []
    while not until(by_key):
        entries = decode(await asyncio.wait_for(receiver.receive(), 60))
        receiver.read_one()
        for kind, value in entries:
            kinds.append(kind)
            if kind == BATCH:
                for key, delta in deltas_from_batch(StreamBatch.unpack(value)):
                    by_key.setdefault(key, []).append(delta)
        if kinds[-1] == END:
            break
    return kinds


def test_a_socket_channels_rows_go_from_the_core_to_its_reader_and_nowhere_else(core, expected):
    """A channel of the socket transport: the core sends its batches to the reader's socket
    itself (the actor gets none of them), one message a step while the reader keeps up, and
    its rows rebuild the engine's tokens; another channel's still come to the actor."""
    async def run():
        receiver = await core.open_socket("direct")
        for key, prompt in enumerate(PROMPTS):
            core.add("direct" if key < 3 else "relayed", key, prompt, _greedy(16))
        by_key: dict[int, list] = {}
        kinds = await _read_socket(receiver, by_key, lambda got: all(_ended(got.get(k, [])) for k in range(3)))
        await core.wait_for(lambda: _ended(core.deltas("relayed").get(3, [])))
        assert await asyncio.wrap_future(core.client.call("close_channel", "direct")) == 0
        assert (await _read_socket(receiver, {}, lambda _: False))[-1] == END   # the channel's end
        receiver.close()
        return by_key, kinds

    by_key, kinds = asyncio.run(run())
    assert "direct" not in core.items
    assert 16 <= kinds.count(BATCH) <= 20 and set(kinds) == {BATCH}
    for key, prompt in enumerate(PROMPTS):
        deltas = by_key[key] if key < 3 else core.deltas("relayed")[key]
        accumulator = OutputAccumulator(str(key), None, prompt)
        final = [accumulator.add(d) for d in deltas][-1]
        assert final.finished and final.outputs[0].token_ids == expected[key]


def test_a_socket_channel_whose_reader_leaves_has_its_requests_aborted_and_is_reported(model, tmp_path):
    """Its requests are aborted, with a warning that counts them; a reader that leaves with nothing
    running on its channel (a replica that stops) is no warning. The core is the test's own: it
    writes its log to a file of the test's (the stderr it inherits as it starts), which also shows
    that transformers' "Loading weights" bar is off in a core."""
    log_path = tmp_path / "core.log"
    with _stderr_to(log_path):
        core = Core(model)

    async def run():
        receiver, idle = await core.open_socket("left"), await core.open_socket("idle")
        core.add("idle", 0, PROMPTS[3], _greedy(3))
        await _read_socket(idle, {}, lambda got: _ended(got.get(0, [])))
        idle.close()   # its handle stopped, with nothing running
        await core.wait_for(lambda: ("gone", "idle") in core.items.get("idle", []))
        core.add("left", 0, PROMPTS[0], _greedy(400))
        core.add("left", 1, PROMPTS[1], _greedy(400))
        core.add("stays", 0, PROMPTS[2], _greedy(12))
        await _read_socket(receiver, {}, lambda got: len(got.get(1, [])) >= 2)
        receiver.close()   # its process died, say
        await core.wait_for(lambda: ("gone", "left") in core.items.get("left", []))
        await core.wait_for(lambda: _ended(core.deltas("stays").get(0, [])))
        status = await asyncio.wrap_future(core.client.call("drain_status"))
        assert status["num_unfinished"] == 0

    try:
        asyncio.run(run())
    finally:
        core.check_and_close()
    assert core.deltas("stays")[0][-1].samples[0].finish_reason == "length"
    log = log_path.read_text()
    assert re.search(r"WARNING \S+: engine core \w+: the reader of output channel left disconnected; "
                     r"aborted its 2 running request\(s\)", log), log
    assert re.search(r"INFO \S+: engine core \w+: the reader of output channel idle disconnected; closed it", log), log
    assert len(re.findall(r"\bWARNING\b", log)) == 1, log
    assert "model dtype" in log and "Loading weights" not in log, log   # transformers' bar is off in a core


@contextlib.contextmanager
def _stderr_to(path):
    """This process's stderr (file descriptor 2, which a child process inherits) goes to ``path``."""
    saved = os.dup(2)
    with open(path, "wb") as file:
        os.dup2(file.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def test_an_engine_that_fails_ends_each_socket_channel_with_its_error(own_core):
    core = own_core

    async def run():
        receiver = await core.open_socket("c")
        core.add("c", 0, PROMPTS[1], _greedy(400))
        await _read_socket(receiver, {}, lambda got: got.get(0))
        await asyncio.wrap_future(core.client.call("inject_failure", "a device error"))
        # The failure comes with the next step, and a core steps only with requests to run: one
        # more, so that it fails even if the first finished meanwhile (a test process held up).
        core.add("c", 1, PROMPTS[0], _greedy(400))
        kinds = await _read_socket(receiver, {}, lambda _: False)
        await core.wait_for(lambda: core.deaths)
        receiver.close()
        await core.wait_for(lambda: core.client._process.poll() is not None)
        return kinds

    kinds = asyncio.run(run())
    assert kinds[-2:] == [DEAD, END]
    assert core.deaths[0][1] == core.info.engine_id
    # The core exited of itself, its last messages sent: the client's reader thread, which its
    # PR_SET_PDEATHSIG is tied to, outlived it rather than SIGKILL it on reading DEAD.
    assert core.client._process.returncode == 1


def test_a_speculating_core_streams_the_tokens_of_one_that_does_not(model, expected):
    """With n-gram speculation a step can make several tokens per row: the packed rows carry
    them (``counts``) and rebuild the same greedy tokens; and it did speculate."""
    started = Core(model, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                              "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    try:
        async def run():
            for key, prompt in enumerate(PROMPTS):
                started.add("c", key, prompt, _greedy(16))
            await started.wait_for(lambda: all(_ended(started.deltas("c").get(k, [])) for k in range(4)))

        asyncio.run(run())
        rows_per_delta = []
        for key, prompt in enumerate(PROMPTS):
            deltas = started.deltas("c")[key]
            accumulator = OutputAccumulator(str(key), None, prompt)
            final = [accumulator.add(d) for d in deltas][-1]
            assert final.finished and final.outputs[0].token_ids == expected[key]
            rows_per_delta += [len(d.samples[0].token_ids) for d in deltas if d.samples]
        stats = started.client.call("stats").result(30)["engine"]
        assert stats["spec_decode_num_accepted_tokens"] > 0 and max(rows_per_delta) > 1
    finally:
        started.check_and_close()


def test_closing_a_channel_aborts_what_runs_on_it_and_nothing_else(core):
    async def run():
        core.add("closed", 0, PROMPTS[0], _greedy(400))
        core.add("closed", 1, PROMPTS[1], _greedy(400))
        core.add("open", 0, PROMPTS[2], _greedy(12))
        await core.wait_for(lambda: len(core.deltas("closed").get(1, [])) >= 2)
        assert await asyncio.wrap_future(core.client.call("close_channel", "closed")) == 2
        await core.wait_for(lambda: _ended(core.deltas("open").get(0, [])) and
                            all(_ended(core.deltas("closed").get(k, [])) for k in (0, 1)))

    asyncio.run(run())
    opened = core.deltas("open")[0]
    assert opened[-1].samples[0].finish_reason == "length"
    for key in (0, 1):
        assert core.deltas("closed")[key][-1].samples[-1].finish_reason == "abort"


def test_a_refused_request_ends_alone_with_its_error(core):
    async def run():
        core.add("c", 0, list(range(3, 603)), _greedy(4))   # the tiny model's context is 512 tokens
        core.add("c", 1, PROMPTS[0], _greedy(4))
        await core.wait_for(lambda: all(_ended(core.deltas("c").get(k, [])) for k in (0, 1)))

    asyncio.run(run())
    refused, served = core.deltas("c")[0], core.deltas("c")[1]
    assert len(refused) == 1 and type(refused[0]) is ValueError and "context" in str(refused[0])
    assert served[-1].finished and len(served[-1].samples[0].token_ids) >= 1


def test_an_engine_that_fails_is_reported_dead_once_with_its_id(own_core):
    core = own_core

    async def run():
        core.add("c", 0, PROMPTS[1], _greedy(400))
        await core.wait_for(lambda: core.deltas("c").get(0))
        await asyncio.wrap_future(core.client.call("inject_failure", "a device error"))
        await core.wait_for(lambda: core.deaths)

    asyncio.run(run())
    [(message, engine_id)] = core.deaths
    assert "injected: a device error" in message and engine_id == core.info.engine_id
    assert not core.client.is_running
    with pytest.raises(CoreDead):
        core.client.call("stats").result(5)


def test_a_killed_core_is_reported_dead_and_calls_fail(model):
    started = Core(model)

    async def run():
        started.add("c", 0, PROMPTS[1], _greedy(400))
        await started.wait_for(lambda: started.deltas("c").get(0))
        os.kill(started.client.pid, signal.SIGKILL)
        await started.wait_for(lambda: started.deaths)

    asyncio.run(run())
    [(message, engine_id)] = started.deaths
    assert "exit code -9" in message and engine_id is None
    with pytest.raises(CoreDead):
        started.client.call("stats").result(5)
    started.check_and_close()


_PARENT = """
import sys, time
from pagedserve.kvmanager import InProcessTransport
from pagedserve.kvmanager.service import KVManagerService
from pagedserve.workers.actor.core_client import EngineCoreClient
from pagedserve.workers.engine.core_process import CoreSpec
spec = CoreSpec("orphan", {"model": sys.argv[1], "device": "cpu", "num_device_blocks": 32, "swap_space_gb": 0.001})
client = EngineCoreClient(spec, InProcessTransport(KVManagerService()), lambda items: None, lambda m, e: None)
client.start(timeout_s=120)
print(client.pid, client._dir, flush=True)
time.sleep(600)
"""


def test_a_core_never_outlives_its_worker_even_one_killed_with_sigkill(model):
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, model], stdout=subprocess.PIPE, text=True)
    try:
        pid, socket_dir = parent.stdout.readline().split()
        core_pid = int(pid)
        assert psutil.Process(core_pid).ppid() == parent.pid
        assert not os.path.exists(socket_dir), "a killed worker would leave its core's socket folder behind"
        _kill_and_see_its_core_end(parent, core_pid)
    finally:
        parent.kill()


_PARENT_NEVER_READY = """
import sys, threading, time
from pagedserve.kvmanager import InProcessTransport
from pagedserve.kvmanager.service import KVManagerService
from pagedserve.workers.actor import core_client
from pagedserve.workers.engine.core_process import CoreSpec

def never(body):   # READY never completes: this worker stays in its core's start
    time.sleep(600)

core_client.CoreInfo.from_body = staticmethod(never)
spec = CoreSpec("loading", {"model": sys.argv[1], "device": "cpu", "num_device_blocks": 32, "swap_space_gb": 0.001})
client = core_client.EngineCoreClient(spec, InProcessTransport(KVManagerService()), lambda items: None,
                                      lambda m, e: None)
print(client._dir, flush=True)
threading.Thread(target=client.start, kwargs={"timeout_s": 600}, daemon=True).start()
while client.pid is None:
    time.sleep(0.01)
print(client.pid, flush=True)
time.sleep(600)
"""


def test_a_worker_killed_before_its_core_is_ready_leaves_no_socket_folder(model):
    """The folder of the core's socket paths goes once the core has its spec, before its model
    loads: here its READY is never taken, and the folder is gone all the same."""
    parent = subprocess.Popen([sys.executable, "-c", _PARENT_NEVER_READY, model], stdout=subprocess.PIPE, text=True)
    try:
        socket_dir = parent.stdout.readline().strip()
        core_pid = int(parent.stdout.readline())
        deadline = time.monotonic() + 120
        while os.path.exists(socket_dir) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(socket_dir), "the folder stays until the core is ready"
        _kill_and_see_its_core_end(parent, core_pid)
    finally:
        parent.kill()


def test_a_core_whose_worker_died_before_it_started_removes_the_socket_folder(tmp_path):
    """A worker killed while its core's interpreter starts (before the core's ``STARTED``, when
    the worker removes the folder) leaves the folder: the core, finding its parent gone, removes it."""
    socket_dir = tmp_path / "pagedserve-core-test"
    socket_dir.mkdir()
    (socket_dir / "progress").write_bytes(b"")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()   # a pid that is not the core's parent
    core = subprocess.run([sys.executable, "-m", "pagedserve.workers.engine.core_process",
                           f"ipc://{socket_dir}/in", f"ipc://{socket_dir}/out", str(socket_dir / "progress"),
                           str(gone.pid)], timeout=120)
    assert core.returncode == 1
    assert not socket_dir.exists()


def test_a_new_worker_removes_the_socket_folders_of_workers_that_are_gone(tmp_path, monkeypatch):
    """A worker killed after making its folder and before its core started (or with a core
    killed with it before ``STARTED``) leaves the folder: the next worker's client removes it,
    and no folder whose owner still runs, nor one without an owner yet."""
    import tempfile

    from pagedserve.workers.actor import socket_folder

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    env = dict(os.environ, TMPDIR=str(tmp_path))
    killed = subprocess.Popen([sys.executable, "-c", "import time\nfrom pagedserve.workers.actor import "
                               "socket_folder\nprint(socket_folder.make(), flush=True)\ntime.sleep(600)"],
                              stdout=subprocess.PIPE, text=True, env=env)
    left = killed.stdout.readline().strip()
    killed.kill()
    killed.wait(10)
    ours = socket_folder.make()                      # this process's: it runs
    reused = socket_folder.make()                    # this pid, another process's start time: a reused pid
    with open(os.path.join(reused, "owner"), "w") as owner:
        owner.write(f"{os.getpid()} 1")
    unowned = tempfile.mkdtemp(prefix=socket_folder.PREFIX)   # its owner has not written it yet
    other = tmp_path / "not-a-core-folder"
    other.mkdir()
    assert left.startswith(str(tmp_path)) and os.path.exists(left)
    client = EngineCoreClient(CoreSpec("sweeper", {}), InProcessTransport(KVManagerService()),
                              lambda items: None, lambda m, e: None)
    try:
        assert not os.path.exists(left) and not os.path.exists(reused)
        assert os.path.exists(ours) and os.path.exists(unowned) and other.exists()
        assert os.path.exists(client._dir) and client._dir.startswith(str(tmp_path))
    finally:
        client.shutdown()
    assert not os.path.exists(client._dir)
    assert socket_folder.sweep() == []               # the rest all stay
    assert os.path.exists(ours) and os.path.exists(unowned)


def _kill_and_see_its_core_end(parent: subprocess.Popen, core_pid: int) -> None:
    """SIGKILL the worker's process; its core must end within 10 s."""
    parent.kill()
    parent.wait(10)
    deadline = time.monotonic() + 10
    while _alive(core_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(core_pid)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_channel_stays_open_while_renewed_and_closes_on_its_lease():
    """A handle's process that died never closes its channel (Ray does not end a streamed call
    whose caller is gone): the lease does, whether or not anybody is in ``take``."""
    closed: list[str] = []

    async def run():
        renewed = OutputChannel("renewed", closed.append, lease_s=0.4)
        orphan = OutputChannel("orphan", closed.append, lease_s=0.4)
        orphan.watch_lease()   # nobody takes from it: the timer still runs

        async def renew():
            while True:
                await asyncio.sleep(0.1)
                renewed.renew()

        renewer = asyncio.create_task(renew())
        with pytest.raises(asyncio.TimeoutError):  # idle for 3 leases: nothing to take, still open
            await asyncio.wait_for(renewed.take(), 1.2)
        assert not renewed.is_closed and orphan.is_closed
        renewed.put(b"batch")
        assert await renewed.take() == [b"batch"]
        renewer.cancel()
        renewed.fail(EngineDeadError("the engine loop failed", "e1"))
        renewed.put(b"last")
        assert await renewed.take() == [b"last"]   # what came before the failure is taken first
        with pytest.raises(EngineDeadError):
            await renewed.take()

    asyncio.run(run())
    assert closed == ["orphan"]


def test_a_stalled_core_shows_its_unfinished_work_and_its_old_progress(core):
    """The worker's heartbeat reads the core's progress: a core stuck in a step with work admitted
    must show that work and a progress clock that stopped, so the cluster restarts it (a request
    admitted to an idle core counts before that step ends, not after)."""
    _, _, steps_before, generated_before = core.client.progress_figures()

    async def run():
        await asyncio.wrap_future(core.client.call("inject_stall", 3.0))
        core.add("c", 0, PROMPTS[0], _greedy(4))
        await asyncio.sleep(1.5)
        last, num_unfinished, _, _ = core.client.progress_figures()
        assert num_unfinished == 1 and time.time() - last >= 1.2
        await core.wait_for(lambda: _ended(core.deltas("c").get(0, [])))

    asyncio.run(run())
    last, num_unfinished, num_steps, num_generated = core.client.progress_figures()
    assert num_unfinished == 0 and num_generated - generated_before == 4 and num_steps - steps_before >= 4
    assert time.time() - last < 5
