"""What one step's message costs between a worker actor and a handle: through a Ray streamed
call (``output_transport: ray``) or a ZeroMQ socket (``zmq``), the CPU of both processes.

A worker's output channel sends one message per engine step to each handle, the step's
packed ``StreamBatch``: a streamed item of a Ray call (``Worker.channel_outputs``), or a
socket message (``workers.outputs.channel_socket``, which also returns a credit per message). Each
message costs the worker's process and the handle's a share of CPU whatever it holds, so
per streamed token that cost is divided by the streams in a step. This measures it
alone: an actor yields ``--messages`` packed batches of ``--rows`` one-token rows, one
every ``--step-ms``, to a reader in this process, through

- ``ray``: a streamed call (``num_returns="streaming"``), the reader awaiting each item;
- ``zmq``: a PUSH socket in the actor to a PULL socket here, over TCP (what a socket
  between nodes would be), the reader on asyncio;
- ``pace``: neither; the actor only sleeps between steps, the reader awaits the end: the
  pacing's own cost, taken off the other two.

Each mode's CPU (user + system, from psutil) of the actor's process and of this one, per
message and per token (per row), the modes alternating ``--rounds`` times.

    python benchmarks/bench_channel_transport.py [--rows 64,256] [--messages 2000] [--step-ms 1] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

import psutil
import ray
import zmq
import zmq.asyncio

from pagedserve.workers.outputs.stream_batch import StreamBatch

MODES = ("pace", "ray", "zmq")


def packed_step(rows: int) -> bytes:
    """A step's batch of ``rows`` plain one-token rows, packed as the engine core packs it."""
    batch = StreamBatch()
    for key in range(rows):
        batch.add(key, 0, [1000 + key])
    return batch.pack()


@ray.remote(num_cpus=0)
class Sender:
    def pid(self) -> int:
        return os.getpid()

    async def pace(self, num_messages: int, step_s: float) -> int:
        for _ in range(num_messages):
            await asyncio.sleep(step_s)
        return num_messages

    async def stream(self, message: bytes, num_messages: int, step_s: float):
        for _ in range(num_messages):
            yield message
            await asyncio.sleep(step_s)

    async def push(self, address: str, message: bytes, num_messages: int, step_s: float) -> int:
        socket = zmq.asyncio.Context.instance().socket(zmq.PUSH)
        socket.connect(address)
        try:
            for _ in range(num_messages):
                await socket.send(message, copy=False)
                await asyncio.sleep(step_s)
            await socket.send(b"")
        finally:
            socket.close(linger=5000)
        return num_messages


async def read(mode: str, sender, message: bytes, num_messages: int, step_s: float) -> int:
    """The messages read through ``mode``."""
    if mode == "pace":
        return await sender.pace.remote(num_messages, step_s)
    if mode == "ray":
        count = 0
        async for ref in sender.stream.options(num_returns="streaming").remote(message, num_messages, step_s):
            await ref
            count += 1
        return count
    socket = zmq.asyncio.Context.instance().socket(zmq.PULL)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    try:
        done = sender.push.remote(f"tcp://127.0.0.1:{port}", message, num_messages, step_s)
        count = 0
        while len(await socket.recv(copy=False)):
            count += 1
        await done
    finally:
        socket.close()
    return count


async def measure(args) -> list[dict]:
    sender = Sender.remote()
    actor, reader = psutil.Process(await sender.pid.remote()), psutil.Process()

    def cpu() -> tuple[float, float]:
        return sum(actor.cpu_times()[:2]), sum(reader.cpu_times()[:2])

    step_s = args.step_ms / 1e3
    rows_list = [int(r) for r in args.rows.split(",")]
    for mode in MODES:   # warm-up: the streamed call's first items, the sockets
        await read(mode, sender, packed_step(rows_list[0]), 50, step_s)
    results = []
    for round_index in range(args.rounds):
        for rows in rows_list:
            message = packed_step(rows)
            by_mode = {}
            for mode in MODES:
                before = cpu()
                count = await read(mode, sender, message, args.messages, step_s)
                after = cpu()
                assert count == args.messages, (mode, count)
                by_mode[mode] = [(a - b) / count * 1e6 for a, b in zip(after, before)]
            pace = by_mode["pace"]
            for mode in ("ray", "zmq"):
                sender_us, reader_us = (by_mode[mode][i] - pace[i] for i in range(2))
                row = {"round": round_index + 1, "rows": rows, "bytes": len(message), "mode": mode,
                       "sender_us_per_message": sender_us, "reader_us_per_message": reader_us,
                       "us_per_token": (sender_us + reader_us) / rows}
                results.append(row)
                print(f"round {row['round']}  {rows} rows ({len(message)} bytes)  {mode}: sender "
                      f"{sender_us:.0f} us, reader {reader_us:.0f} us a message over pacing alone "
                      f"({pace[0]:.0f}, {pace[1]:.0f}); {row['us_per_token']:.2f} us a token", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="64,256", help="rows (streams) per message, comma-separated")
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--step-ms", type=float, default=1.0, help="pause between messages")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        start = time.perf_counter()
        asyncio.run(measure(args))
        print(f"({time.perf_counter() - start:.0f} s)")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
