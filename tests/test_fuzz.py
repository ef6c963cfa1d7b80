"""The fuzz suite: hostile requests against the live Ray Serve deployment.

One Ray instance, one-worker cluster and Serve application per module (a
64-token context and small limits, so every case is quick). While the cases
run, a canary thread repeats a greedy request and must get its reference
text every time; after every test the server answers ``/health``, nothing is
left running, no block is in use and the KV accounting is consistent.

* schemathesis, positive and negative cases, from the app's ``/openapi.json``;
* a hypothesis generator of hostile bodies: huge, negative, NaN and infinite
  numbers, wrong types, unicode edge cases (lone surrogates, NUL), empty and
  oversized prompts and message lists, thousands of stop strings, ``n`` of
  10,000, token-id prompts outside the vocabulary, raw non-JSON bodies;
* hostile gRPC messages and undecodable bytes;
* slow-loris bodies and headers, half-closed and abandoned streams;
* prompt text never reaches any log file.

Pass criteria: no 5xx (a 503 would have to carry Retry-After; none is
expected), the server never dies, the canary is unaffected. Short form by
default; ``--long-form`` runs about 20x the examples. Set
``PAGEDSERVE_FUZZ_REPORT=FILE`` to write the per-category tallies as JSON.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
httpx = pytest.importorskip("httpx")
grpc = pytest.importorskip("grpc")
schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402

from pagedserve.cluster import ray_compat  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from served_cluster import cluster_config, free_port, running_cluster  # noqa: E402

pytestmark = [pytest.mark.fuzz, pytest.mark.distributed, pytest.mark.timeout(1800)]

MODEL = "tiny-fuzz"
MAX_MODEL_LEN = 64
BODY_LIMIT = 64 * 1024
BODY_READ_TIMEOUT_S = 2.0
LONG_FORM_FACTOR = 20
MARKER = f"canary-{uuid.uuid4().hex[:10]}"  # appears in prompts; must never appear in a log
CANARY_PROMPT = f"{MARKER} The paged KV cache splits every sequence into blocks"
ALLOWED_STATUSES = {200, 400, 404, 408, 413, 429}
ERROR_STATUSES = ALLOWED_STATUSES - {200}

TALLY: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


class Canary:
    """Repeats one greedy request in a thread; every answer must be the reference text."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.body = {"model": MODEL, "prompt": CANARY_PROMPT, "max_tokens": 12, "temperature": 0,
                     "ignore_eos": True}
        self.reference = self._ask()
        self.num_ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._running = threading.Event()  # cleared while paused
        self._running.set()
        self._asking = threading.Lock()    # held for each request
        self._thread = threading.Thread(target=self._run, daemon=True, name="fuzz-canary")
        self._thread.start()

    def _ask(self) -> str:
        response = httpx.post(self.url + "/v1/completions", json=self.body, timeout=60)
        response.raise_for_status()
        return response.json()["choices"][0]["text"]

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._running.wait(timeout=0.2):
                continue
            with self._asking:
                if not self._running.is_set():  # paused after the wait above
                    continue
                try:
                    text = self._ask()
                except Exception as exc:  # a failed canary is a finding: keep it for the assertion
                    self.failures.append(repr(exc))
                else:
                    if text == self.reference:
                        self.num_ok += 1
                    else:
                        self.failures.append(f"text {text!r} != reference {self.reference!r}")
            self._stop.wait(0.2)

    @contextlib.contextmanager
    def paused(self):
        """No canary request in flight inside: a block count then sees only the test's own."""
        self._running.clear()
        with self._asking:  # the request under way, if any, finishes first
            pass
        try:
            yield
        finally:
            self._running.set()

    def assert_unaffected(self, num_ok_before: int) -> None:
        assert not self.failures, self.failures[:5]
        deadline = time.time() + 30
        while self.num_ok <= num_ok_before and time.time() < deadline:
            time.sleep(0.1)
        assert self.num_ok > num_ok_before, "the canary made no progress"

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


@dataclass
class Served:
    handle: object
    url: str
    host: str
    port: int
    grpc_target: str
    vocab_size: int
    logs_dir: Path
    canary: Canary = field(init=False)


@pytest.fixture(scope="module")
def served(tiny_model):
    from pagedserve.cluster.serving.deployment import deploy

    # On a loaded machine Serve's proxy may need longer than its 5 s ready check to come up.
    for name, seconds in (("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60"),
                          ("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "60")):
        os.environ.setdefault(name, seconds)
    port, grpc_port = free_port(), free_port()
    engine = {"num_device_blocks": 256, "swap_space_gb": 0.001, "max_model_len": MAX_MODEL_LEN}
    limits = {"max_request_body_bytes": BODY_LIMIT, "body_read_timeout_s": BODY_READ_TIMEOUT_S,
              "max_queued_requests": 256, "stream_idle_timeout_s": 30}
    config = cluster_config(tiny_model("llama"), MODEL, engine, num_workers=1, port=port, grpc_port=grpc_port,
                            limits=limits)
    with running_cluster(config) as cluster:
        handle = cluster.handle
        canary = None
        try:
            endpoints = deploy(handle, cluster.config)
            logs_dir = ray_compat.session_logs_dir()
            served = Served(handle, endpoints["http"], "127.0.0.1", port, endpoints["grpc"],
                            len(handle.tokenizer), logs_dir)
            canary = served.canary = Canary(served.url)
            yield served
        finally:
            if canary is not None:
                canary.stop()
                TALLY["canary"].update(ok=canary.num_ok, failed=len(canary.failures))
            _write_report()


@pytest.fixture(autouse=True)
def unharmed(served):
    """After each test: the canary kept its answer, the server is healthy, nothing leaked."""
    num_ok_before = served.canary.num_ok
    yield
    _write_report()
    served.canary.assert_unaffected(num_ok_before)
    assert httpx.get(served.url + "/health", timeout=30).json()["status"] == "ok"
    with served.canary.paused():
        served.handle.wait_idle(timeout=60)
        assert served.handle.num_used_blocks() == 0
        served.handle.check_integrity()


def _write_report() -> None:
    path = os.environ.get("PAGEDSERVE_FUZZ_REPORT")
    if path:
        Path(path).write_text(json.dumps({k: dict(v) for k, v in TALLY.items()}, indent=2, sort_keys=True))


def _examples(base: int, long_form: bool) -> int:
    return base * (LONG_FORM_FACTOR if long_form else 1)


def _header(response, name: str) -> str:
    """A header of an httpx or schemathesis response (whose values are lists)."""
    for key, value in response.headers.items():
        if key.lower() == name:
            return value[0] if isinstance(value, list) else value
    return ""


def _check_response(response, category: str) -> None:
    """No 5xx; errors in OpenAI's shape; a stream that started ends with [DONE] (a Responses
    API stream with its last event)."""
    status = response.status_code
    TALLY[category][str(status)] += 1
    assert status < 500, (status, response.text[:500])
    assert status in ALLOWED_STATUSES, (status, response.text[:500])
    content_type = _header(response, "content-type")
    if status in ERROR_STATUSES:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        if status == 429:
            assert int(_header(response, "retry-after")) >= 1
    elif content_type.startswith("text/event-stream"):
        text = response.text
        # schemathesis stops reading a stream after a few events and hangs up (the server
        # then aborts the request); only a stream read to its end must finish with [DONE].
        events = [json.loads(line[len("data: "):]) for line in text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        if getattr(response, "stream_cut_short", False):
            TALLY[category]["streams cut short by the client"] += 1
        elif text.startswith("event: "):   # the Responses API's named events: no [DONE]
            assert events[-1]["type"] in ("response.completed", "response.incomplete", "response.failed", "error"), text[-300:]
        else:
            assert text.rstrip().endswith("data: [DONE]"), text[-300:]


# ---- schemathesis -------------------------------------------------------------------------------
def test_schemathesis_against_the_openapi_schema(served, long_form):
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error

    schema = schemathesis.openapi.from_url(served.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    labels = {op.label for op in operations}
    expected = {"POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses", "GET /v1/models"}
    assert expected <= labels, labels
    for operation in operations:
        is_generation = operation.method.upper() == "POST"
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            category = f"schemathesis {mode.value} {operation.label}"

            @settings(max_examples=_examples(40 if is_generation else 4, long_form), deadline=None,
                      suppress_health_check=list(HealthCheck), database=None)
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case):
                response = case.call(base_url=served.url, timeout=120)
                case.validate_response(response, checks=[not_a_server_error])
                _check_response(response, category)

            try:
                run()
            except Unsatisfiable:  # nothing to negate: a route without parameters or body
                assert mode == GenerationMode.NEGATIVE, operation.label


# ---- hypothesis: hostile requests ---------------------------------------------------------------
HUGE_NUMBERS = st.sampled_from([10**30, -10**30, 2**63, 2**64 + 1, -2**63 - 1, 1e308, -1e308, 5e-324, -0.0,
                                -1, 0, 1.5, 2**31, 10**4000])
RAW_CONSTANTS = st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1" * 5000])
WRONG_TYPES = st.one_of(st.none(), st.booleans(), st.text(max_size=5), st.lists(st.integers(), max_size=3),
                        st.dictionaries(st.text(max_size=3), st.integers(), max_size=2), st.floats())
NUMERIC_FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "n", "seed", "logprobs", "presence_penalty",
                  "frequency_penalty", "repetition_penalty", "min_p", "priority", "best_of"]
UNICODE_EDGES = st.sampled_from(["\ud800", "\udfff", "\x00", "a\x00b", "\u202e", "\ufeff", "🦙" * 50, "e\u0301",
                                 "\U0010ffff", "\r\n", "\u2028", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", " ", ""])
TEXTS = st.one_of(st.text(max_size=40), UNICODE_EDGES, st.lists(UNICODE_EDGES, max_size=8).map("".join))


@st.composite
def hostile_requests(draw, vocab_size: int) -> tuple[str, str, bytes]:
    """``(category, path, body bytes)`` for one hostile request."""
    category = draw(st.sampled_from(["numbers", "raw constants", "wrong types", "unicode", "empty/oversized",
                                     "stop strings", "n", "token ids", "messages", "responses items",
                                     "not json"]))
    path = {"messages": "/v1/chat/completions", "responses items": "/v1/responses"}.get(category, "/v1/completions")
    body: dict = {"model": MODEL, "prompt": f"{MARKER} {draw(TEXTS)}", "max_tokens": draw(st.integers(1, 8))}
    if draw(st.booleans()):
        body["stream"] = True
    raw: bytes | None = None
    if category == "numbers":
        for name in draw(st.lists(st.sampled_from(NUMERIC_FIELDS), min_size=1, max_size=4)):
            body[name] = draw(HUGE_NUMBERS)
    elif category == "raw constants":
        name = draw(st.sampled_from(NUMERIC_FIELDS))
        text = json.dumps({**body, name: 0})
        raw = text.replace(f'"{name}": 0', f'"{name}": {draw(RAW_CONSTANTS)}').encode()
    elif category == "wrong types":
        for name in draw(st.lists(st.sampled_from(NUMERIC_FIELDS + ["prompt", "stop", "stream", "model", "echo",
                                                                     "stream_options", "logit_bias", "user"]),
                                  min_size=1, max_size=3)):
            body[name] = draw(WRONG_TYPES)
    elif category == "unicode":
        body["prompt"] = draw(TEXTS) + MARKER
        if draw(st.booleans()):
            body["stop"] = [draw(TEXTS) for _ in range(draw(st.integers(1, 4)))]
        if draw(st.booleans()):
            body["model"] = draw(TEXTS)
    elif category == "empty/oversized":
        body["prompt"] = draw(st.sampled_from(["", [], [[]], [""], MARKER * 20, MARKER * 8000, [MARKER] * 400,
                                               [[1] * 70] * 3, [1] * 100000]))
    elif category == "stop strings":
        body["stop"] = [draw(TEXTS) for _ in range(draw(st.sampled_from([17, 1000, 5000])))]
    elif category == "n":
        body["n"] = draw(st.sampled_from([10000, 17, 16, 0, -1]))
        body["best_of"] = draw(st.sampled_from([None, body["n"], 10000]))
    elif category == "token ids":
        ids = st.one_of(st.integers(-2**70, -1), st.integers(vocab_size, 2**70), st.integers(0, vocab_size - 1))
        body["prompt"] = draw(st.one_of(st.lists(ids, min_size=1, max_size=10),
                                        st.lists(st.lists(ids, min_size=1, max_size=5), min_size=1, max_size=3)))
        if draw(st.booleans()):
            body["stop_token_ids"] = draw(st.lists(ids, max_size=5))
    elif category == "messages":
        del body["prompt"]
        roles = st.sampled_from(["system", "user", "assistant", "tool", "developer", "robot", "", None])
        message = st.fixed_dictionaries({"role": roles, "content": st.one_of(TEXTS.map(lambda t: MARKER + t),
                                                                            st.none(), WRONG_TYPES)})
        body["messages"] = draw(st.one_of(st.lists(message, max_size=4),
                                          st.sampled_from([[], [{"role": "user", "content": MARKER}] * 3000,
                                                           [{"role": "user"}], [{}], "hello", None])))
    elif category == "responses items":
        # The Responses API's input items: kinds it runs, kinds it refuses, and shapes of neither.
        body = {"model": MODEL, "max_output_tokens": body["max_tokens"], "stream": body.get("stream", False)}
        kinds = st.one_of(st.sampled_from(["message", "function_call", "function_call_output", "item_reference",
                                           "reasoning", "input_text", "output_text", "input_image"]), WRONG_TYPES)
        part = st.fixed_dictionaries({"type": kinds}, optional={"text": TEXTS, "image_url": TEXTS})
        content = st.one_of(TEXTS.map(lambda t: MARKER + t), st.lists(part, max_size=3), WRONG_TYPES)
        item = st.fixed_dictionaries({}, optional={
            "type": kinds, "role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "robot"]),
            "content": content, "call_id": TEXTS, "name": TEXTS, "arguments": TEXTS, "output": content,
            "id": TEXTS})
        body["input"] = draw(st.one_of(TEXTS.map(lambda t: MARKER + t), st.lists(st.one_of(item, WRONG_TYPES),
                                                                                  max_size=4), WRONG_TYPES))
        if draw(st.booleans()):
            body["instructions"] = draw(st.one_of(TEXTS, WRONG_TYPES))
    else:
        raw = draw(st.sampled_from([b"", b"{", b"null", b"[]", b"\xff\xfe\x00", b'{"prompt": "x"}' * 3,
                                    b'{"prompt": "\xed\xa0\x80"}', b"[" * 50000, b"{}" + b" " * 70000,
                                    b'{"prompt": 1}']))
    if raw is None:
        raw = json.dumps(body, ensure_ascii=True).encode()
    return category, path, raw


def test_hostile_requests(served, long_form):
    client = httpx.Client(base_url=served.url, timeout=120)

    @settings(max_examples=_examples(120, long_form), deadline=None, suppress_health_check=list(HealthCheck),
              database=None)
    @given(request=hostile_requests(served.vocab_size))
    def run(request):
        category, path, raw = request
        response = client.post(path, content=raw, headers={"Content-Type": "application/json"})
        _check_response(response, f"hostile {category}")

    try:
        run()
    finally:
        client.close()


# ---- gRPC -----------------------------------------------------------------------------------------
def _grpc_requests(vocab_size: int):
    from pagedserve.cluster.protos import pagedserve_pb2 as pb

    floats = st.one_of(st.floats(width=32), st.sampled_from([float("nan"), float("inf"), -1.0, 0.0]))
    uint32 = st.integers(0, 2**32 - 1)
    fields = st.fixed_dictionaries({}, optional={
        "model": st.sampled_from(["", MODEL, "other", "\x00"]),
        "prompt": TEXTS.filter(lambda t: not any(0xD800 <= ord(c) <= 0xDFFF for c in t)).map(lambda t: MARKER + t),
        "prompt_token_ids": st.lists(uint32, max_size=8),
        "max_tokens": st.one_of(st.integers(0, 8), uint32), "temperature": floats, "top_p": floats,
        "top_k": st.integers(-2**31, 2**31 - 1), "min_p": floats, "n": st.sampled_from([0, 1, 2, 17, 10000, 2**32 - 1]),
        "stop": st.lists(st.text(max_size=3).filter(lambda t: not any(0xD800 <= ord(c) <= 0xDFFF for c in t)),
                         max_size=40),
        "seed": st.integers(-2**63, 2**63 - 1), "logprobs": st.sampled_from([0, 1, 20, 21, 2**32 - 1]),
        "priority": st.integers(-2**31, 2**31 - 1), "repetition_penalty": floats,
        "request_id": st.sampled_from(["", "same", "x" * 10000]),
    })
    return fields.map(lambda kwargs: pb.GenerateRequest(**kwargs))


# Every hostile request ends well within this: the context is MAX_MODEL_LEN tokens.
GRPC_CLIENT_TIMEOUT_S = 120


def test_hostile_grpc_requests(served, long_form):
    from pagedserve.cluster.protos import pagedserve_pb2 as pb
    from pagedserve.cluster.protos import pagedserve_pb2_grpc as pb_grpc

    # DEADLINE_EXCEEDED only as the server's own answer (a 408, well inside the client's deadline):
    # a request that reaches the client's deadline hung.
    allowed = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
               grpc.StatusCode.DEADLINE_EXCEEDED}
    metadata = (("application", "pagedserve"),)
    with grpc.insecure_channel(served.grpc_target) as channel:
        stub = pb_grpc.PagedServeStub(channel)

        @settings(max_examples=_examples(40, long_form), deadline=None, suppress_health_check=list(HealthCheck),
                  database=None)
        @given(request=_grpc_requests(served.vocab_size), is_stream=st.booleans())
        def run(request, is_stream):
            start = time.monotonic()
            try:
                if is_stream:
                    list(stub.GenerateStream(request, metadata=metadata, timeout=GRPC_CLIENT_TIMEOUT_S))
                else:
                    stub.Generate(request, metadata=metadata, timeout=GRPC_CLIENT_TIMEOUT_S)
                TALLY["grpc"]["OK"] += 1
            except grpc.RpcError as exc:
                TALLY["grpc"][exc.code().name] += 1
                assert time.monotonic() - start < GRPC_CLIENT_TIMEOUT_S, f"no answer: {request}"
                assert exc.code() in allowed, (exc.code(), exc.details())

        run()
        # Bytes that are no protobuf at all, to both methods.
        for method in ("Generate", "GenerateStream"):
            garbage = channel.unary_unary(f"/pagedserve.PagedServe/{method}", request_serializer=lambda b: b,
                                          response_deserializer=lambda b: b)
            for payload in (b"\xff" * 64, b"\x0a\xff\xff\xff\xff\x0f", os.urandom(256)):
                with pytest.raises(grpc.RpcError) as info:
                    garbage(payload, metadata=metadata, timeout=60)
                TALLY["grpc garbage"][info.value.code().name] += 1
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        ok = stub.Generate(pb.GenerateRequest(prompt=CANARY_PROMPT, max_tokens=12, temperature=0, ignore_eos=True),
                           metadata=metadata, timeout=60)
        assert ok.choices[0].text == served.canary.reference


# ---- slow and broken connections ----------------------------------------------------------------
def _connect(served) -> socket.socket:
    return socket.create_connection((served.host, served.port), timeout=30)


def _request_head(path: str, content_length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: fuzz\r\nContent-Type: application/json\r\n"
            f"Content-Length: {content_length}\r\n\r\n").encode()


def _read_status(sock: socket.socket, timeout_s: float) -> int | None:
    """The status code of the response on ``sock``, or None if it closed without one."""
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            return None
        data += chunk
    return int(data.split(b" ", 2)[1])


def test_slow_loris_body_is_cut_off(served):
    body = json.dumps({"prompt": MARKER, "max_tokens": 2}).encode()
    sock = _connect(served)
    try:
        sock.sendall(_request_head("/v1/completions", len(body) + 50))
        start = time.monotonic()
        sent = 0
        sock.settimeout(0.01)
        status = None
        while time.monotonic() - start < BODY_READ_TIMEOUT_S + 20:
            if sent < len(body):
                try:
                    sock.send(body[sent:sent + 1])
                    sent += 1
                except OSError:  # the server hung up: it cut the client off
                    break
            try:
                status = _read_status(sock, 0.5)
                break
            except (TimeoutError, socket.timeout):
                continue
        elapsed = time.monotonic() - start
    finally:
        sock.close()
    TALLY["slow loris body"][str(status)] += 1
    assert status == 408, status
    assert elapsed < BODY_READ_TIMEOUT_S + 15
    assert sent < len(body)  # cut off long before the body could finish


def test_slow_headers_and_idle_connections_do_not_block_others(served):
    sockets = []
    try:
        for index in range(20):
            sock = _connect(served)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: fuzz\r\n")  # and never finish the headers
            sockets.append(sock)
        for _ in range(5):
            response = httpx.post(served.url + "/v1/completions", timeout=60,
                                  json={"prompt": CANARY_PROMPT, "max_tokens": 12, "temperature": 0,
                                        "ignore_eos": True})
            assert response.json()["choices"][0]["text"] == served.canary.reference
        TALLY["slow headers"]["others served"] += 5
    finally:
        for sock in sockets:
            sock.close()


def _stream_body(n: int = 8, max_tokens: int = 36) -> bytes:
    """A streamed request that fits the context: its prompt is ~23 of MAX_MODEL_LEN's 64 tokens, and
    a stated ``max_tokens`` that cannot fit is refused (400), not cut."""
    return json.dumps({"prompt": f"{MARKER} once upon a time", "max_tokens": max_tokens, "n": n,
                       "ignore_eos": True, "stream": True}).encode()


def _read_first_event(sock: socket.socket) -> None:
    """Read a stream's response up to its first event: the request was accepted (200) and runs."""
    sock.settimeout(60)
    data = b""
    while b"data: " not in data:  # the first event (the body is chunked)
        chunk = sock.recv(4096)
        assert chunk, "the server closed before the first event"
        data += chunk
        # A refusal has no events: fail on it at once rather than wait out the timeout.
        assert not data.startswith(b"HTTP/") or b" 200 " in data.split(b"\r\n", 1)[0], data[:300]


def test_half_closed_and_abandoned_streams_free_their_blocks(served):
    body = _stream_body()
    outcomes = collections.Counter()
    for mode in ("half-close then read", "read one event then close", "read one event then reset",
                 "never read then close"):
        sock = _connect(served)
        try:
            sock.sendall(_request_head("/v1/completions", len(body)) + body)
            if mode == "half-close then read":
                sock.shutdown(socket.SHUT_WR)
                data = b""
                sock.settimeout(60)
                while chunk := sock.recv(65536):
                    data += chunk
                status = int(data.split(b" ", 2)[1]) if data else None
                outcomes[f"{mode}: {status}, complete={b'data: [DONE]' in data}"] += 1
                assert status in (None, 200)
            elif mode == "never read then close":
                time.sleep(1.0)
                outcomes[mode] += 1
            else:
                _read_first_event(sock)
                if mode.endswith("reset"):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                outcomes[mode] += 1
        finally:
            sock.close()
        with served.canary.paused():  # the canary's own blocks would hide a leak's absence
            deadline = time.time() + 60
            while served.handle.num_used_blocks() and time.time() < deadline:
                time.sleep(0.1)
            assert served.handle.num_used_blocks() == 0, mode
    TALLY["half-closed streams"].update(outcomes)


def test_concurrent_abandoned_streams(served):
    """Many clients start long streams and vanish at once, each after its first event (every
    stream was accepted and running); the canary keeps its answer meanwhile."""
    body = _stream_body(n=4, max_tokens=40)
    sockets = []
    try:
        for _ in range(16):
            sock = _connect(served)
            sock.sendall(_request_head("/v1/completions", len(body)) + body)
            sockets.append(sock)
        for sock in sockets:
            _read_first_event(sock)
    finally:
        for sock in sockets:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            sock.close()
    TALLY["abandoned streams"]["closed"] += len(sockets)


# ---- logs -----------------------------------------------------------------------------------------
def _log_files_holding(served, text: str) -> list[str]:
    return [str(path) for path in served.logs_dir.rglob("*")
            if path.is_file() and path.stat().st_size < 200 * 1024 * 1024 and text.encode() in path.read_bytes()]


def test_prompts_never_reach_the_logs(served):
    """Every earlier test sent ``MARKER`` in prompts (valid and invalid ones); no log file may hold it.

    The control: an app with ``log_requests`` on, whose prompt must show up in the same files.
    """
    from ray import serve

    from pagedserve.cluster.serving.deployment import deploy

    response = httpx.post(served.url + "/v1/completions", timeout=60, json={"prompt": MARKER * 500})
    assert response.status_code == 400  # too long: the error message must not quote it either
    assert MARKER not in response.text
    control = f"control-{uuid.uuid4().hex[:10]}"
    chatty = served.handle.config.model_copy(deep=True)
    chatty.server.log_requests = True
    try:
        url = deploy(served.handle, chatty, app_name="pagedserve-chatty", route_prefix="/chatty")["http"]
        logged = httpx.post(url + "/v1/completions", json={"prompt": control, "max_tokens": 2}, timeout=60)
        assert logged.status_code == 200
        deadline = time.time() + 30
        while not _log_files_holding(served, control) and time.time() < deadline:
            time.sleep(0.5)
    finally:
        serve.delete("pagedserve-chatty")
    assert _log_files_holding(served, control), "the control prompt was not logged: the scan sees nothing"
    hits = _log_files_holding(served, MARKER)
    TALLY["log files scanned"]["files"] = sum(1 for p in served.logs_dir.rglob("*") if p.is_file())
    assert not hits, hits
