"""The server's own cost per streamed token: from the handle's outputs to SSE bytes.

A Serve replica runs the HTTP app (``cluster.serving``) over ``ClusterHandle``: for
every output of every streamed request it wakes the request's ``Generation``,
builds the API's chunk, frames it as a server-sent event and hands it to the ASGI
server. This measures that path alone, in one process and one event loop, with no
Ray, Serve proxy or engine: ``--streams`` concurrent streamed ``/v1/completions``
(or ``--api chat``, ``--api responses``) requests through the real FastAPI app, called as an ASGI
server calls it, over a stand-in handle whose outputs come from a real
``OutputAccumulator`` fed one ``OutputDelta`` per request per "step" (what a
worker's output channel delivers), every stream one token per step.

Reported, side by side in the same run: the process CPU per output token through
the app, and per output token of the stand-in alone (the same outputs consumed
straight from the handle); the difference is what the app adds per token. With
``--floor``, also a bare FastAPI route that streams one constant chunk per output
of the same stand-in: what FastAPI's streaming response costs by itself, the
floor of what the app adds.

    python benchmarks/bench_frontend_stream.py [--streams 64] [--tokens 256] [--floor]
        [--api completions|chat|responses]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from pagedserve.workers.outputs.accumulator import OutputAccumulator
from pagedserve.workers.actor.protocol import OutputDelta, SampleDelta
from pagedserve.workers.outputs.request_output import RequestMetrics


class _SteppedHandle:
    """The part of ``ClusterHandle`` the frontend uses, its outputs made by a stepping task:
    every ``step_s`` each live request gets one token (a one-token ``OutputDelta``), as a
    worker's output channel delivers one message per engine step."""

    def __init__(self, model_path: str, tokenizer, max_model_len: int, step_s: float) -> None:
        self.model_path = model_path
        self.model_name = "bench"
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.workers: dict = {}
        self.step_s = step_s
        self._queues: dict[str, tuple[asyncio.Queue, int]] = {}
        self._stepper: asyncio.Task | None = None

    def generate(self, prompt, params, request_id=None, priority=0, prompt_token_ids=None, is_streamed=False,
                 lora_request=None, token_by_token=False):
        assert not token_by_token, "this stand-in streams the engine's outputs as they come"
        return self._generate(prompt, params, request_id, prompt_token_ids or [])

    async def _generate(self, prompt, params, request_id, prompt_token_ids):
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = (queue, params.max_tokens)
        if self._stepper is None or self._stepper.done():
            self._stepper = asyncio.create_task(self._step())
        accumulator = OutputAccumulator(request_id, prompt, prompt_token_ids)
        try:
            while True:
                delta = await queue.get()
                output = accumulator.add(delta)
                yield output
                if delta.finished:
                    return
        finally:
            self._queues.pop(request_id, None)

    async def _step(self) -> None:
        token_ids = range(50, 80)
        sent: dict[str, int] = {}
        while self._queues:
            now = time.time()
            for request_id, (queue, max_tokens) in list(self._queues.items()):
                count = sent.get(request_id, 0) + 1
                sent[request_id] = count
                is_last = count >= max_tokens
                token = token_ids[count % len(token_ids)]
                # Metrics come on a request's first and last delta (``DeltaEncoder``'s milestones), the
                # count of its tokens on its last (``deltas_from_batch``).
                metrics = (RequestMetrics(now - 1.0, now - 0.9, now - 0.8, now if is_last else None, 16, count)
                           if count == 1 or is_last else None)
                queue.put_nowait(OutputDelta(request_id, [SampleDelta(0, [token], f" w{count % 10}",
                                                                      finish_reason="length" if is_last else None)],
                                             is_last, metrics, num_generated_tokens=count if is_last else None))
            await asyncio.sleep(self.step_s)


async def _drive(app, body: dict, path: str) -> int:
    """One request through the ASGI app as an ASGI server calls it; returns the body's bytes."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    received = False
    size = 0
    done = asyncio.Event()

    async def receive():
        nonlocal received
        if not received:
            received = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        nonlocal size
        if message["type"] == "http.response.body":
            size += len(message.get("body", b""))
            if not message.get("more_body"):
                done.set()

    await app(scope, receive, send)
    return size


async def _run_app(app, streams: int, tokens: int, api: str) -> tuple[float, float]:
    if api == "responses":   # the stand-in ends each stream at its token limit: no EOS to ignore
        path, body = "/v1/responses", {"model": "bench", "input": "Hi", "stream": True, "max_output_tokens": tokens}
    else:
        if api == "chat":
            path, body = "/v1/chat/completions", {"model": "bench", "messages": [{"role": "user", "content": "Hi"}]}
        else:
            path, body = "/v1/completions", {"model": "bench", "prompt": "Hello there"}
        body.update(stream=True, max_tokens=tokens, ignore_eos=True)
    await asyncio.gather(*(_drive(app, body, path) for _ in range(2)))  # warm-up
    cpu, wall = time.process_time(), time.perf_counter()
    sizes = await asyncio.gather(*(_drive(app, body, path) for _ in range(streams)))
    assert all(sizes), "a stream sent nothing"
    return time.process_time() - cpu, time.perf_counter() - wall


def _bare_app(handle):
    """A FastAPI route streaming one constant completion chunk per output of ``handle``."""
    import itertools

    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse

    from pagedserve import SamplingParams

    chunk = ('data: {"id":"cmpl-0123456789abcdef0123456789abcdef","object":"text_completion","created":1764370000,'
             '"model":"bench","choices":[{"index":0,"text":" w1","logprobs":null,"finish_reason":null,'
             '"stop_reason":null,"prompt_logprobs":null}],"usage":null}\n\n')
    request_ids = itertools.count()
    app = FastAPI()

    async def stream(request):
        body = await request.json()
        params = SamplingParams(max_tokens=body["max_tokens"], ignore_eos=True)
        outputs = handle.generate(None, params, f"bare-{next(request_ids)}", prompt_token_ids=[1, 2, 3])

        async def lines():
            async for _ in outputs:
                yield chunk
            yield "data: [DONE]\n\n"
        return StreamingResponse(lines(), media_type="text/event-stream")

    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        app.router.add_route(path, stream, methods=["POST"])
    return app


async def _run_handle(handle, streams: int, tokens: int) -> tuple[float, float]:
    from pagedserve import SamplingParams

    params = SamplingParams(max_tokens=tokens, ignore_eos=True)

    async def one(i: int):
        async for _ in handle.generate(None, params, f"direct-{i}", prompt_token_ids=[1, 2, 3]):
            pass

    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(streams)))
    return time.process_time() - cpu, time.perf_counter() - wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--api", choices=["completions", "chat", "responses"], default="completions")
    parser.add_argument("--step-ms", type=float, default=0.0, help="pause between steps (0: back to back)")
    parser.add_argument("--floor", action="store_true", help="also measure a bare FastAPI streaming route")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from pagedserve.cluster.config import ServerConfig
    from pagedserve.cluster.serving.frontend import Frontend
    from pagedserve.cluster.serving.http_app import build_app
    from pagedserve.devtools.model_factory import ensure_model
    from pagedserve.workers.process.gc_heap import prepare_serving_heap

    model_path = str(ensure_model("llama", "tiny"))
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    handle = _SteppedHandle(model_path, tokenizer, 4096, args.step_ms / 1e3)
    server = Frontend(handle, ServerConfig())
    app = build_app(server)
    bare_app = _bare_app(handle) if args.floor else None
    prepare_serving_heap("bench")   # as a Serve replica does once it has started
    num_tokens = args.streams * args.tokens
    rounds = []
    for _ in range(args.rounds):
        app_cpu, app_wall = asyncio.run(_run_app(app, args.streams, args.tokens, args.api))
        handle_cpu, handle_wall = asyncio.run(_run_handle(handle, args.streams, args.tokens))
        rounds.append({"app_us_per_token": app_cpu / num_tokens * 1e6,
                       "handle_only_us_per_token": handle_cpu / num_tokens * 1e6,
                       "app_tok_s": num_tokens / app_wall, "handle_only_tok_s": num_tokens / handle_wall})
        if bare_app is not None:
            bare_cpu, _ = asyncio.run(_run_app(bare_app, args.streams, args.tokens, args.api))
            rounds[-1]["bare_app_us_per_token"] = bare_cpu / num_tokens * 1e6
    for r in rounds:
        r["app_adds_us_per_token"] = r["app_us_per_token"] - r["handle_only_us_per_token"]
        floor = ""
        if "bare_app_us_per_token" in r:
            r["bare_app_adds_us_per_token"] = r["bare_app_us_per_token"] - r["handle_only_us_per_token"]
            floor = f"; a bare FastAPI streaming route adds {r['bare_app_adds_us_per_token']:.1f} us"
        print(f"{args.api}: {args.streams} streams x {args.tokens} tokens: through the app "
              f"{r['app_us_per_token']:.1f} us CPU per token ({r['app_tok_s']:,.0f} tok/s), the stand-in "
              f"handle alone {r['handle_only_us_per_token']:.1f} us ({r['handle_only_tok_s']:,.0f} tok/s): "
              f"the app adds {r['app_adds_us_per_token']:.1f} us per token{floor}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rounds": rounds}, f, indent=2)


if __name__ == "__main__":
    main()
