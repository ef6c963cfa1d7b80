"""The floor of serving a streamed token over Ray Serve: the ingress and one SSE write, nothing else.

A Ray Serve application on a private Ray, deployed as pagedserve deploys its own (FastAPI,
the same ingress: HAProxy by default, or Serve's proxy actor), whose ``/v1/completions``
streams pre-rendered completion chunks, one per stream per "step": a producer task in the
replica ticks as fast as its event loop allows and wakes each live stream once a tick, which
writes its chunk (one wake-up and one ``send`` per token, as pagedserve's responses do). No
engine, no handle, no text decoding. ``pagedserve bench serve --cpu-per-token`` drives it with
the same client, workload and process accounting as a real server, so its CPU per streamed
token (replica, HAProxy or proxy actor, Ray's daemons) is what any server on this stack pays
at least: the floor the served figures are judged against.

``--busy-cpus N`` keeps N processes spinning beside the server while it is loaded, as a
worker's engine core keeps a CPU busy during a served run: the floor measured on the CPUs a
real server's ingress has left (on a small machine the ingress, HAProxy and the client then
share fewer cores, and every write wakes a process that must take a core from another).

``--work-us U`` spins U µs of the replica's CPU before each chunk, as a server's own work per
token (the handle's read, text decoding, the chunk) would: whether spreading the writes out
costs more than the work itself.

``--tok-s R`` paces the ticks so that the streams together make about R tokens a second, as
an engine's steps pace a served run: the floor at a served run's rate. Unpaced, the floor
streams several times faster than a served run on the same machine, so the costs that run
by the second (Serve's controller, Ray's daemons) and the ingress's wake-ups, each for a
burst of writes, weigh on each of its tokens several times less.

``--pin`` puts the busy processes on one CPU and the server, its load client and Ray on the
others, as ``bench_serving_cpu.py --pin-engine-core`` pins a served run.

``--waves W`` sends W times ``--streams`` requests, at most ``--streams`` at once, and
``--length-ratio`` spreads their output lengths (``bench_serving_cpu.py``'s sustained load):
the floor of the same load, per-request costs included in the same proportion, rather than
one burst (whose 64 x 16 tokens last a fraction of a second, a few clock ticks of CPU).

    python benchmarks/bench_serve_floor.py [--streams 64] [--tokens 256] [--ingress haproxy] [--busy-cpus 1]
                                           [--work-us 20] [--tok-s 5000] [--pin] [--waves 4 --length-ratio 0.5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from fastapi import Request   # at module level: the route's annotation is resolved in its globals

from pagedserve.bench.cpu_pinning import split_cpus

CHUNK_TEXT = " the"


def build_app(work_us: float = 0.0, tok_s: float = 0.0):
    """The FastAPI app: ``/v1/models`` and a streamed ``/v1/completions`` (``work_us`` of CPU
    spun before each chunk; ticks paced to ``tok_s`` tokens a second, 0: as fast as the loop goes)."""
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    app = FastAPI()
    streams: list[list] = []   # [event, chunks sent, tokens asked] per live stream
    ticker: dict = {}

    async def tick() -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while streams:
            for stream in list(streams):
                stream[0].set()
            if tok_s:   # the next step once this one's tokens are due at the rate
                next_at = max(next_at + len(streams) / tok_s, loop.time() - 0.1)
                await asyncio.sleep(max(next_at - loop.time(), 0.0))
            else:
                await asyncio.sleep(0)   # one step: the streams write, then the next
        ticker.pop("task", None)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "floor", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        max_tokens = int(body.get("max_tokens", 16))
        created = int(time.time())
        head = ('data: {"id":"cmpl-floor","object":"text_completion","created":%d,"model":"floor",'
                '"choices":[{"index":0,"text":' % created)
        chunk = (head + json.dumps(CHUNK_TEXT) + ',"logprobs":null,"finish_reason":null}]}\n\n').encode()
        last = (head + json.dumps(CHUNK_TEXT) + ',"logprobs":null,"finish_reason":"length"}]}\n\n').encode()
        usage = ('data: {"id":"cmpl-floor","object":"text_completion","created":%d,"model":"floor","choices":[],'
                 '"usage":{"prompt_tokens":16,"completion_tokens":%d,"total_tokens":%d}}\n\n'
                 % (created, max_tokens, max_tokens + 16)).encode()

        async def events():
            stream = [asyncio.Event(), 0, max_tokens]
            streams.append(stream)
            if "task" not in ticker:
                ticker["task"] = asyncio.get_running_loop().create_task(tick())
            try:
                for sent in range(max_tokens):
                    await stream[0].wait()
                    stream[0].clear()
                    if work_us:
                        started = time.perf_counter()
                        while time.perf_counter() - started < work_us * 1e-6:
                            pass
                    yield last if sent == max_tokens - 1 else chunk
            finally:
                streams.remove(stream)
            yield usage + b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def serve_floor(port: int, ingress_name: str, work_us: float, tok_s: float) -> None:
    """This process: a private Ray with ``ingress_name``'s environment, the floor app deployed
    as pagedserve's own is, serving until killed."""
    import ray
    from ray import serve

    from pagedserve.cluster import ray_compat
    from pagedserve.cluster.serving import ingress
    from pagedserve.cluster.serving.deployment import APP_NAME

    ingress.prepare(ingress_name)
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="WARNING")
    app = build_app(work_us, tok_s)

    @serve.deployment(name="PagedServe", max_ongoing_requests=1100,
                      ray_actor_options={"num_cpus": 0, **ray_compat.head_node_placement()})
    @serve.ingress(app)
    class Floor:
        pass

    serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config={"log_level": "WARNING"})
    serve.run(Floor.bind(), name=APP_NAME, route_prefix="/", logging_config={"log_level": "WARNING"})
    print("floor serving", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))   # atexit then shuts the private Ray down
    while True:
        time.sleep(3600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--ingress", default="haproxy", choices=("haproxy", "proxy"))
    parser.add_argument("--port", type=int, default=8131)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--busy-cpus", type=int, default=0,
                        help="processes spinning beside the server while it is loaded (an engine core's CPU)")
    parser.add_argument("--work-us", type=float, default=0.0,
                        help="µs of the replica's CPU spun before each chunk (a server's own work per token)")
    parser.add_argument("--tok-s", type=float, default=0.0,
                        help="tokens a second the streams make together (a served run's rate); 0: unpaced")
    parser.add_argument("--pin", action="store_true",
                        help="the busy processes on one CPU, the server and its load on the others (as "
                             "bench_serving_cpu.py --pin-engine-core pins a served run)")
    parser.add_argument("--waves", type=int, default=1,
                        help="requests: this many times --streams, at most --streams at once (1: one burst)")
    parser.add_argument("--length-ratio", type=float, default=0.0,
                        help="output lengths uniform within this ratio of --tokens (with --waves)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)   # the server's own process
    args = parser.parse_args()
    if args.serve:
        serve_floor(args.port, args.ingress, args.work_us, args.tok_s)
        return
    busy_cpus = None
    if args.pin:   # what this process starts inherits the other CPUs
        busy_cpus, other_cpus = split_cpus()
        os.sched_setaffinity(0, other_cpus)
    server = subprocess.Popen([sys.executable, __file__, "--serve", "--port", str(args.port), "--ingress", args.ingress,
                               "--work-us", str(args.work_us), "--tok-s", str(args.tok_s)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "floor serving", "the floor app did not start"
        with tempfile.TemporaryDirectory() as workdir:
            for _ in range(args.rounds):
                out = os.path.join(workdir, "floor.json")
                on_busy_cpus = (lambda: os.sched_setaffinity(0, busy_cpus)) if busy_cpus else None
                spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=on_busy_cpus)
                            for _ in range(args.busy_cpus)]
                try:
                    done = subprocess.run(
                        [sys.executable, "-m", "pagedserve", "bench", "serve", "--port", str(args.port), "--model",
                         "floor", "--request-rate", "inf", "--num-requests", str(args.streams * args.waves),
                         "--max-concurrency", str(args.streams), "--random-input-len", "16",
                         "--random-output-len", str(args.tokens), "--random-range-ratio", str(args.length_ratio),
                         "--seed", "0", "--no-progress",
                         "--cpu-per-token", "--server-pid", str(server.pid), "--out", out],
                        capture_output=True, text=True, timeout=900)
                finally:
                    for spinner in spinners:
                        spinner.kill()
                        spinner.wait()
                if not os.path.exists(out):
                    raise RuntimeError(f"bench serve failed ({done.returncode}): {done.stderr[-2000:]}")
                with open(out) as f:
                    data = json.load(f)
                if data["failed"]:
                    print(f"{data['failed']} requests failed: {data['errors'][:3]}", flush=True)
                cpu = data["cpu_per_token"]
                print(json.dumps({"ingress": args.ingress, "streams": args.streams, "tokens": args.tokens,
                                  "waves": args.waves, "length_ratio": args.length_ratio,
                                  "busy_cpus": args.busy_cpus, "work_us": args.work_us, "tok_s_paced": args.tok_s,
                                  "output_tok_s": round(data["output_throughput"]),
                                  "server_us": round(cpu["server_total"]["us_per_token"], 1),
                                  "groups": {k: round(g["us_per_token"], 1) for k, g in cpu["groups"].items()},
                                  "failed": data["failed"]}), flush=True)
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    main()
