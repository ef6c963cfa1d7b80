"""LoRA adapters through the server: named in the configuration (``model.lora_modules``),
found in ``model.dynamic_lora_loading_path`` or loaded and unloaded at run time
(``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``), selected by a request's ``model`` (the
adapter's name, or "BASE:NAME"), listed by ``/v1/models`` with their parent, refused by name when
unknown (404) or unservable (400).

One Ray instance, two CPU workers with ``enable_lora`` and the Serve application, driven by
the official ``openai`` client and plain HTTP; a request goes to a worker that holds its
adapter. Each request's greedy tokens must equal the
offline engine's with the same ``LoRARequest`` (which ``test_lora.py`` holds equal to
transformers + PEFT), also when requests of both adapters and of the base model share
steps. After every test the cluster is idle with no block in use.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from peft_adapters import make_peft_adapter  # noqa: E402
from served_cluster import assert_idle, cluster_config, running_cluster  # noqa: E402

from pagedserve import LLM, LoRARequest, SamplingParams  # noqa: E402
from pagedserve.cluster.bootstrap import NAMESPACE  # noqa: E402
from pagedserve.cluster.runtime_adapters import RuntimeAdapterRegistry  # noqa: E402

MODEL = "tiny-lora"
# The adapters' weights in pages of the KV pool (unified paging), served as in slots.
ENGINE = {"num_device_blocks": 256, "swap_space_gb": 0.001, "enable_lora": True, "max_loras": 2,
          "max_lora_rank": 8, "lora_paging": "unified"}
# name -> (rank, targets); "wide" is past max_lora_rank: configured, but refused when asked for.
ADAPTERS = {"attn": (8, ["q_proj", "v_proj"]), "mlp": (4, ["gate_proj", "up_proj", "down_proj"]),
            "wide": (16, ["q_proj"]), "dyn": (4, ["v_proj", "o_proj"])}
CONFIGURED = ("attn", "mlp", "wide")   # "dyn" is found in the dynamic directory
PROMPTS = [[5, 17, 301, 44, 9, 12, 700], [8, 8, 93, 260, 31], [400, 2, 77, 19, 5, 61, 88, 140, 3]]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapter_paths(tiny_model, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("served-lora")
    return {name: make_peft_adapter(tiny_model("llama"), root / name, rank, 2 * rank, targets, seed=i + 1)
            for i, (name, (rank, targets)) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def served(tiny_model, adapter_paths):
    from pagedserve.cluster.serving.deployment import deploy

    config = cluster_config(tiny_model("llama"), MODEL, ENGINE, num_workers=2)
    config["model"]["lora_modules"] = [{"name": name, "path": adapter_paths[name]} for name in CONFIGURED]
    config["model"]["dynamic_lora_loading_path"] = str(Path(adapter_paths["dyn"]).parent)
    config["model"]["allow_runtime_lora_updating"] = True
    with running_cluster(config, num_cpus=2) as cluster:
        endpoints = deploy(cluster.handle, cluster.config, quiet=True)
        yield cluster.handle, endpoints["http"]


@pytest.fixture(scope="module")
def expected(tiny_model, adapter_paths) -> dict[str | None, list[list[int]]]:
    """Greedy tokens of every prompt offline, per adapter (None: the base model)."""
    llm = LLM(tiny_model("llama"), device="cpu", dtype="float32", swap_space_gb=0.001, **{
        k: v for k, v in ENGINE.items() if k not in ("num_device_blocks", "swap_space_gb")})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = {}
    for index, name in enumerate([None, "attn", "mlp", "dyn"]):
        lora = None if name is None else LoRARequest(name, index, adapter_paths[name])
        results = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=lora)
        outputs[name] = [list(result.outputs[0].token_ids) for result in results]
    return outputs


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(autouse=True)
def idle_after(served):
    yield
    assert_idle(served[0])


def _tokens(client, model: str, prompt: list[int]) -> tuple[str, list[int]]:
    response = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
    return response.model, response.choices[0].token_ids


def test_models_lists_the_base_and_its_adapters(client, adapter_paths):
    cards = {card.id: card for card in client.models.list().data}
    assert {MODEL, *CONFIGURED} <= set(cards) <= {MODEL, *ADAPTERS}
    assert getattr(cards[MODEL], "parent", None) is None
    for name in CONFIGURED:
        assert cards[name].parent == MODEL and cards[name].root == adapter_paths[name]
    assert client.models.retrieve(f"{MODEL}:attn").id == "attn"


def test_an_adapter_named_as_model_generates_what_it_does_offline(client, expected):
    assert expected["attn"] != expected[None] and expected["mlp"] != expected[None]  # the adapters matter
    for model, name in ((MODEL, None), ("attn", "attn"), (f"{MODEL}:mlp", "mlp")):
        for prompt, tokens in zip(PROMPTS, expected[name]):
            assert _tokens(client, model, prompt) == (name or MODEL, tokens)


def test_adapters_and_the_base_model_share_steps(client, expected):
    jobs = [(model, name, i) for i in range(len(PROMPTS)) for model, name in
            ((MODEL, None), ("attn", "attn"), ("mlp", "mlp"))] * 2
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: _tokens(client, job[0], PROMPTS[job[2]]), jobs))
    for (model, name, i), (echoed, tokens) in zip(jobs, results):
        assert echoed == model and tokens == expected[name][i]


def test_an_adapters_requests_go_to_the_worker_that_holds_it(served, client):
    def adapter_routes() -> int:
        stats = httpx.get(served[1] + "/stats", timeout=30).json()
        return stats["router"]["reasons"].get("adapter", 0)

    before = adapter_routes()
    for i in range(3):
        for name in ("attn", "mlp"):   # new prompts: no cached prefix decides
            _tokens(client, name, [11 + i, 300 + i, 7, 900 - i])
    assert adapter_routes() - before >= 4


def test_status_and_metrics_show_each_workers_adapters(served, client):
    """``pagedserve status`` has LoRA lines per worker (slots, host memory, reads; the pages its
    adapters hold in the KV pool); /metrics has vLLM's ``vllm:lora_requests_info`` per engine,
    with ``max_lora``."""
    from prometheus_client.parser import text_string_to_metric_families

    from pagedserve.cluster.launcher import format_status

    _tokens(client, "attn", PROMPTS[0])
    stats = served[0].stats()
    lora = {worker_id: worker["lora"] for worker_id, worker in stats["workers"].items()}
    assert any("attn" in figures["slot_adapters"] for figures in lora.values()), lora
    status = format_status(stats)
    for worker_id in lora:
        assert f"{worker_id}: LoRA adapters: " in status and f"of {ENGINE['max_loras']} slots" in status
        assert f"{worker_id}: LoRA pages in the KV pool: " in status
    holder = next(worker_id for worker_id, figures in lora.items() if "attn" in figures["paged_adapters"])
    pool = stats["kv_manager"]["workers"][holder]
    assert pool["device_blocks_adapter_pages"] == lora[holder]["adapter_pages"] + 1 > 1   # and the zero page
    text = httpx.get(served[1] + "/metrics", timeout=30).text
    info = [sample for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name == "vllm:lora_requests_info"]
    assert {sample.labels["engine"] for sample in info} == set(lora)
    assert all(sample.labels["max_lora"] == str(ENGINE["max_loras"]) and sample.value > 0 for sample in info)


def test_workers_report_the_adapters_they_hold_to_the_kv_manager(served, client):
    """Each worker reports the adapters it holds over its KV event link; the central manager's
    route hints name the holders of a request's adapter (by its cache key, "ID:NAME")."""
    handle = served[0]
    _tokens(client, "mlp", PROMPTS[1])

    def reported() -> dict[str, list[str]]:
        workers = ray.get(handle.kv_manager.stats.remote(), timeout=30)["workers"]
        return {worker_id: entry["adapters"] for worker_id, entry in workers.items()}

    _until(lambda: any("2:mlp" in keys for keys in reported().values()))
    _, holders = ray.get(handle.kv_manager.route_hints.remote(PROMPTS[1], None, "2:mlp"), timeout=30)
    held = reported()
    assert holders == sorted(w for w, keys in held.items() if "2:mlp" in keys)
    assert set(held) == set(handle.workers)


def test_a_streamed_chat_names_its_adapter_in_every_chunk(client):
    stream = client.chat.completions.create(model="attn", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=6, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks and all(chunk.model == "attn" for chunk in chunks)


def test_an_adapter_of_the_dynamic_directory_is_found_on_its_first_request(client, expected, adapter_paths):
    for prompt, tokens in zip(PROMPTS, expected["dyn"]):
        assert _tokens(client, f"{MODEL}:dyn", prompt) == ("dyn", tokens)
    card = client.models.retrieve("dyn")
    assert card.parent == MODEL and card.root == adapter_paths["dyn"]


def test_an_unknown_adapter_is_a_404_naming_it(client):
    for model in ("nope", f"{MODEL}:nope", "other:attn", f"{MODEL}:..", f"{MODEL}:../dyn", "dyn/x"):
        with pytest.raises(openai.NotFoundError) as caught:
            client.completions.create(model=model, prompt=[5, 6], max_tokens=2)
        assert f"the model `{model}` does not exist" in str(caught.value)


def test_an_adapter_past_max_lora_rank_is_refused_and_others_go_on(served, client, expected):
    with ThreadPoolExecutor(2) as pool:
        good = pool.submit(_tokens, client, "attn", PROMPTS[0])
        response = httpx.post(served[1] + "/v1/completions", timeout=120,
                              json={"model": "wide", "prompt": [5, 6, 7], "max_tokens": 4})
        assert good.result() == ("attn", expected["attn"][0])
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert "wide" in message and "max_lora_rank" in message


# ---- adapters loaded at run time ------------------------------------------------------------
@pytest.fixture(scope="module")
def runtime_adapters(tiny_model, tmp_path_factory) -> dict[str, tuple[str, list[list[int]]]]:
    """Two adapters outside the dynamic directory, with different weights: name -> (path, the
    greedy tokens of every prompt offline)."""
    root = tmp_path_factory.mktemp("runtime-lora")
    llm = LLM(tiny_model("llama"), device="cpu", dtype="float32", swap_space_gb=0.001, **{
        k: v for k, v in ENGINE.items() if k not in ("num_device_blocks", "swap_space_gb")})
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    built = {}
    for index, (name, targets) in enumerate((("rt1", ["q_proj", "o_proj"]), ("rt2", ["up_proj", "down_proj"]))):
        path = make_peft_adapter(tiny_model("llama"), root / name, 4, 8, targets, seed=20 + index)
        results = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=LoRARequest(name, index + 1, path))
        built[name] = (path, [list(result.outputs[0].token_ids) for result in results])
    return built


def _until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.time() + timeout_s
    while not predicate():
        assert time.time() < deadline, "timed out"
        time.sleep(0.1)


def _post(served, route: str, **body) -> httpx.Response:
    return httpx.post(served[1] + route, json=body, timeout=120)


def test_an_adapter_loaded_at_run_time_is_served_listed_and_unloaded(served, client, runtime_adapters, expected):
    """vLLM's routes: load "tenant", serve it (every prompt as offline), list it; a second load of
    the name is a 400; unloaded, it is a 404 to requests and to another unload; loaded again from
    other weights, the requests get the new adapter's tokens (no block of the first one's)."""
    (path1, tokens1), (path2, tokens2) = runtime_adapters["rt1"], runtime_adapters["rt2"]
    served[0].health.start()   # the driver's handle: a view like another replica's
    assert tokens1 != expected[None] and tokens2 != tokens1
    response = _post(served, "/v1/load_lora_adapter", lora_name="tenant", lora_path=path1)
    assert response.status_code == 200 and response.text == "Success: LoRA adapter 'tenant' added successfully."
    for prompt, tokens in zip(PROMPTS, tokens1):
        assert _tokens(client, "tenant", prompt) == ("tenant", tokens)
    assert _tokens(client, f"{MODEL}:tenant", PROMPTS[0]) == ("tenant", tokens1[0])
    card = client.models.retrieve("tenant")
    assert card.parent == MODEL and card.root == path1
    # Another replica's view (the driver's handle) gets it from the controller's report, and a
    # restarted controller would find it in Ray's GCS.
    _until(lambda: getattr(served[0].adapters.get("tenant"), "lora_path", None) == path1)
    assert RuntimeAdapterRegistry(NAMESPACE).snapshot()[1]["tenant"][1] == path1

    again = _post(served, "/v1/load_lora_adapter", lora_name="tenant", lora_path=path2)
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    assert "The lora adapter 'tenant' has already been loaded." in again.json()["error"]["message"]

    response = _post(served, "/v1/unload_lora_adapter", lora_name="tenant")
    assert response.status_code == 200 and response.text == "Success: LoRA adapter 'tenant' removed successfully."
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="tenant", prompt=PROMPTS[0], max_tokens=2)
    assert "tenant" not in {card.id for card in client.models.list().data}
    gone = _post(served, "/v1/unload_lora_adapter", lora_name="tenant")
    assert gone.status_code == 404 and "The lora adapter 'tenant' cannot be found." in gone.text
    _until(lambda: served[0].adapters.get("tenant") is None)
    assert "tenant" not in RuntimeAdapterRegistry(NAMESPACE).snapshot()[1]

    assert _post(served, "/v1/load_lora_adapter", lora_name="tenant", lora_path=path2).status_code == 200
    for prompt, tokens in zip(PROMPTS, tokens2):     # the first prompt's blocks were cached for path1
        assert _tokens(client, "tenant", prompt) == ("tenant", tokens)
    assert _post(served, "/v1/unload_lora_adapter", lora_name="tenant").status_code == 200


def test_an_adapter_that_cannot_be_served_is_refused_at_load_naming_why(served, client, adapter_paths, tmp_path):
    cases = [
        ({"lora_name": "big", "lora_path": adapter_paths["wide"]}, "lora_path", "max_lora_rank"),
        ({"lora_name": "none", "lora_path": str(tmp_path / "none")}, "lora_path", "no adapter directory"),
        ({"lora_name": MODEL, "lora_path": adapter_paths["attn"]}, "lora_name", "base model"),
        ({"lora_name": f"{MODEL}:x", "lora_path": adapter_paths["attn"]}, "lora_name", "no ':'"),
        ({"lora_name": "attn", "lora_path": adapter_paths["mlp"]}, "lora_name", "has already been loaded"),
        ({"lora_name": "x"}, "lora_path", "lora_path"),
        ({"lora_name": "x", "lora_path": adapter_paths["attn"], "lora_alias": 1}, "lora_alias", "lora_alias"),
    ]
    for body, param, words in cases:
        response = _post(served, "/v1/load_lora_adapter", **body)
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert error["param"] == param and words in error["message"], (body, error)
    assert {"big", "none", "x"}.isdisjoint(card.id for card in client.models.list().data)
    configured = _post(served, "/v1/unload_lora_adapter", lora_name="attn")
    assert configured.status_code == 400 and "model.lora_modules" in configured.json()["error"]["message"]
    assert _tokens(client, "attn", PROMPTS[0])[0] == "attn"


# ---- last: it drains a worker away ----------------------------------------------------------
DRAIN_MAX_TOKENS = 160


def test_draining_a_worker_migrates_its_adapters_sequences_with_their_kv(served, tiny_model, adapter_paths):
    """A worker drained mid-stream hands its sequences of both adapters over through KV migration
    (only adapters' sequences run: any migration is one of theirs): the target reads the adapter
    if it must, and every stream's tokens are the offline engine's, with no token recomputed."""
    import asyncio

    handle = served[0]
    loras = [LoRARequest("attn", 1, adapter_paths["attn"]), LoRARequest("mlp", 2, adapter_paths["mlp"])]
    jobs = [(PROMPTS[i % len(PROMPTS)], loras[i % len(loras)]) for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=DRAIN_MAX_TOKENS, ignore_eos=True)
    llm = LLM(tiny_model("llama"), device="cpu", dtype="float32", swap_space_gb=0.001, **{
        k: v for k, v in ENGINE.items() if k not in ("num_device_blocks", "swap_space_gb")})
    expected = [list(llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0].outputs[0].token_ids)
                for prompt, lora in jobs]
    recomputed_before = handle.stats()["num_recomputed_tokens"]
    _until(lambda: all(handle.worker_states()["workers"][w]["state"] == "ready" for w in handle.workers), 60)
    progress = {i: 0 for i in range(len(jobs))}
    drained: list[str] = []

    def unfinished() -> dict[str, int]:
        return {w: ray.get(actor.num_unfinished.remote(), timeout=30) for w, actor in handle.workers.items()}

    async def one(index: int, prompt: list[int], lora) -> list[int]:
        last = None
        async for output in handle.generate(prompt, params, request_id=f"drain-{index}-{time.time_ns()}",
                                            lora_request=lora):
            last = output
            progress[index] = len(output.outputs[0].token_ids)
            if not drained and all(n >= 2 for n in progress.values()):
                counts = unfinished()
                victim = max(counts, key=counts.get)
                if counts[victim] >= 2:
                    drained.append(victim)
                    assert ray.get(handle.controller.drain_worker.remote(victim), timeout=30)
        return list(last.outputs[0].token_ids)

    async def run_all():
        return await asyncio.gather(*(one(i, prompt, lora) for i, (prompt, lora) in enumerate(jobs)))

    assert asyncio.run(run_all()) == expected
    assert drained, "no worker held two sequences at once"
    _until(lambda: handle.worker_states()["workers"][drained[0]]["state"] == "dead", 120)
    record = handle.worker_states()["workers"][drained[0]]
    assert record["reason"] == "drained" and record["num_drain_migrations"] >= 1, record
    assert handle.stats()["num_recomputed_tokens"] == recomputed_before
