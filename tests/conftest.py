"""Shared fixtures (tiny checkpoints built once, greedy references from transformers, Ray
clusters) and the suite-wide check that no Ray process outlives the module that started it."""

from __future__ import annotations

import contextlib
import gc
import os
import time

# The cyclic collector stays off while the test process collects (imports torch, transformers,
# Ray and every test module), as the serving processes start: see ``pytest_collection_finish``.
gc.disable()

import pytest  # noqa: E402
import torch  # noqa: E402
from ray_leftovers import SuiteScope, kill, wait_for_exit  # noqa: E402
from greedy_reference import GreedyReference  # noqa: E402

# Triton reads TRITON_INTERPRET when it is first imported (transformers and ray
# import it too), so CPU machines must choose the interpreter before any test does.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Ray starts its workers (our engines, KV manager, Serve's replicas) at niceness 15, under
# any process at 0: a test process computing (a transformers reference, hypothesis) beside
# another module's cluster starved that cluster's actors. Under ``make test``'s two test
# processes, test_distributed_layouts took 420-450 s instead of its 56 s alone.
os.environ.setdefault("RAY_worker_niceness", "0")
# Under ``-n 2`` (``make test``) two test processes share the machine's two cores: one torch
# thread each, and for the processes each starts.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# Before any Ray starts: what existed before the suite, the mark its processes inherit, and
# the directory its Ray clusters keep their sessions in (ray_leftovers).
SUITE = SuiteScope.begin()
# How long a module's Ray processes may take to exit after its fixtures shut Ray down.
LEFTOVER_GRACE_S = 30.0
_LEFTOVERS = pytest.StashKey[list]()        # (where, seconds waited, processes) per finding
_LEFTOVER_WAIT_S = pytest.StashKey[list]()  # seconds each module's check waited


def pytest_configure(config):
    config.stash[_LEFTOVERS] = []
    config.stash[_LEFTOVER_WAIT_S] = []
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        gc.enable()   # pytest-xdist's controller: its test processes collect, it never does


# The packages the suite leans on most; CI's interpreter keeps the versions it has installed.
REPORTED_PACKAGES = ("torch", "transformers", "ray", "pydantic", "fastapi", "starlette", "openai", "triton",
                     "hypothesis")


def _package_versions() -> str:
    """The versions a failure may depend on (the end of every run's report: ``-q`` drops the header)."""
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str:
        with contextlib.suppress(PackageNotFoundError):
            return version(name)
        return "absent"

    return "packages: " + ", ".join(f"{name} {installed(name)}" for name in REPORTED_PACKAGES)


def pytest_collection_finish(session):
    """Collected with the cyclic collector off (0.70x the CPU of a collection with it on: 11.6
    against 16.9 CPU-seconds, ``--collect-only``, medians of three alternating, 2-core CPU VM):
    collect once, freeze what is alive, so that the tests' full collections skip the imported
    heap as the serving processes' do (``workers.process.gc_heap``), and turn it back on.

    Ray Serve is imported first: the import gives Serve's logger a handler on ``sys.stderr`` as it
    is then, here the session's capture. Imported first inside a test with ``capsys``, the handler
    would keep that test's stream, closed after it, and every later Serve log line in the process
    would print "--- Logging error --- ... I/O operation on closed file"."""
    with contextlib.suppress(ImportError):
        import ray.serve  # noqa: F401
    gc.collect()
    gc.freeze()
    gc.enable()


def pytest_unconfigure(config):
    """Unfreeze the heap ``pytest_collection_finish`` froze, so that the interpreter's last
    collection frees its cycles (frozen, Triton's compiler objects outlive it, and nanobind
    reports them as "leaked instances" when the process exits)."""
    gc.unfreeze()


@pytest.fixture(scope="module", autouse=True)
def no_ray_leftovers(request):
    """After each module (its fixtures torn down first): every Ray process it started has ended.
    Leftovers are recorded against the module, killed so they do not slow the rest of the
    suite, and fail the session at its end (``pytest_sessionfinish``)."""
    yield
    started = time.monotonic()
    leftovers = wait_for_exit(SUITE.leftovers, LEFTOVER_GRACE_S)
    waited_s = time.monotonic() - started
    request.config.stash[_LEFTOVER_WAIT_S].append(waited_s)
    if leftovers:
        request.config.stash[_LEFTOVERS].append(
            (request.module.__name__, round(waited_s, 1), [str(p) for p in leftovers]))
        kill(leftovers)


def pytest_sessionfinish(session, exitstatus):
    with contextlib.suppress(OSError):   # only when no Ray ran: Ray's sessions (logs) are kept
        os.rmdir(SUITE.ray_root)
    leftovers = SUITE.leftovers()
    if leftovers:
        session.config.stash[_LEFTOVERS].append(("the session's end", 0.0, [str(p) for p in leftovers]))
        kill(leftovers)
    if session.config.stash[_LEFTOVERS] and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, config):
    terminalreporter.line(_package_versions())
    waits = config.stash.get(_LEFTOVER_WAIT_S, [])
    if any(w >= 0.5 for w in waits):
        terminalreporter.line(f"Ray processes took {sum(waits):.1f} s in all to exit after module teardowns "
                              f"(longest {max(waits):.1f} s)")
    found = config.stash.get(_LEFTOVERS, [])
    if not found:
        return
    terminalreporter.section("Ray processes left behind", sep="=", red=True, bold=True)
    for where, waited_s, processes in found:
        terminalreporter.line(f"after {where} (still alive {waited_s} s after its teardown; killed):", red=True)
        for process in processes:
            terminalreporter.line(f"    {process}")


# Every module that takes over about 15 s, slowest first (one clean-clone run's JUnit times, with
# cold model, Triton and inductor caches, on this 2-core machine, 2026-12-02). Under ``-n 2 --dist
# loadfile`` (``make test``) each worker takes whole modules in collection order, so starting with
# the longest keeps one worker from finishing alone on a long module at the end. A module missing
# here runs after these; a stale figure only costs packing, never coverage.
SLOWEST_MODULES = (
    "test_serve_cli", "test_tensor_parallel", "test_kernels_triton", "test_chaos", "test_autoscaling", "test_first_run",
    "test_api_clients", "test_distributed", "test_fuzz", "test_soak", "test_distributed_layouts", "test_torch_compile",
    "test_lora", "test_ingress_replicas", "test_model_source", "test_cli_autoscaling", "test_bench",
    "test_engine_core", "test_distributed_tp", "test_server", "test_gpu_targets", "test_lora_serving", "test_models",
    "test_dashboard", "test_beam_search", "test_output_processor", "test_kernel_variants",
    "test_kv_scale", "test_device_waits", "test_placement_watch", "test_spec_decode_serving", "test_health",
    "test_spec_decode_distribution", "test_spec_decode_draft_serving", "test_engine", "test_kv_relay",
    "test_fake_cluster", "test_structured_outputs", "test_lora_kernels", "test_kv_wire", "test_lora_tensor_parallel",
    "test_spec_decode", "test_kv_replay", "test_request_bounds", "test_merged_projections", "test_ray_compat",
    "test_openai_api",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rpartition(".")[2], len(rank)))
    if not config.getoption("--long-form"):
        skip = pytest.mark.skip(reason="a long-form variant: runs under --long-form (make test-all)")
        for item in items:
            if item.get_closest_marker("long_form"):
                item.add_marker(skip)


def pytest_addoption(parser):
    parser.addoption("--long-form", action="store_true", default=False,
                     help="run the long forms of the soak, chaos and fuzz suites")


@pytest.fixture(scope="session")
def long_form(request) -> bool:
    """True under ``--long-form``: soak/chaos/fuzz suites run their long versions."""
    return bool(request.config.getoption("--long-form"))


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for the module, restored after: the tiny models run fastest so,
    and the suite shares 2 cores. Use with ``pytestmark = pytest.mark.usefixtures(...)``."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="session")
def tiny_model():
    """``tiny_model(arch) -> str``: path of the cached tiny random checkpoint of ``arch``.

    Built once into the default cache (``$PAGEDSERVE_CACHE_DIR`` or
    ``~/.cache/pagedserve``); later sessions reuse it.
    """
    from pagedserve.devtools.model_factory import ensure_model

    paths: dict[str, str] = {}

    def get(arch: str = "llama") -> str:
        if arch not in paths:
            paths[arch] = str(ensure_model(arch, "tiny"))
        return paths[arch]

    return get


@pytest.fixture(scope="session")
def hf_greedy(tiny_model):
    """``hf_greedy(arch, prompt_token_ids, max_tokens, **generate_kwargs) -> list[int]``:
    transformers' greedy tokens (``greedy_reference``) for the tiny checkpoint of ``arch``,
    memoised per (arch, prompt, max_tokens, kwargs)."""
    from transformers import AutoModelForCausalLM

    return GreedyReference(lambda arch: AutoModelForCausalLM.from_pretrained(tiny_model(arch), dtype=torch.float32))


@pytest.fixture(scope="module")
def matrix_greedy():
    """``matrix_greedy(name, prompt, max_tokens, path=None) -> list[int]``: transformers'
    greedy tokens (``greedy_reference``) for a matrix checkpoint, memoised per module.
    ``path``: another checkpoint of that family (a variant of it)."""
    from transformers import AutoModelForCausalLM

    from pagedserve.devtools.model_matrix import ensure_matrix_model

    reference = GreedyReference(lambda path: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    return lambda name, prompt, max_tokens, path=None: reference(str(path or ensure_matrix_model(name)), prompt,
                                                                   max_tokens)


@pytest.fixture(scope="module")
def local_ray():
    """A local Ray of two CPUs per module, no dashboard: for stand-in actors."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def ray_cluster(request):
    """A ``ray.cluster_utils.Cluster`` per module: a head node (no dashboard: the code under test
    has its fallbacks for one without, and it costs each start 2 s) plus fake-GPU worker nodes.

    The module may set ``RAY_WORKER_NODES`` (how many nodes with ``num_gpus=1``
    and two CPUs; default 2) and ``RAY_ENV_VARS`` (environment of the job's
    workers). The driver is connected in the ``pagedserve`` namespace.
    """
    import ray
    from ray.cluster_utils import Cluster

    num_nodes = getattr(request.module, "RAY_WORKER_NODES", 2)
    env_vars = getattr(request.module, "RAY_ENV_VARS", None)
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    for _ in range(num_nodes):
        cluster.add_node(num_cpus=2, num_gpus=1)
    cluster.wait_for_nodes()
    runtime_env = {"env_vars": env_vars} if env_vars else None
    ray.init(address=cluster.address, namespace="pagedserve", runtime_env=runtime_env)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(params=["native", "python"])
def keyset_impl(request, monkeypatch):
    """The central index's ``KeySet`` for the test: the native one (skipped where it is not
    built) or the pure-Python fallback, patched into ``cluster_index`` for the test."""
    from pagedserve.kvmanager import cluster_index, keyset

    if request.param == "native":
        if not keyset.NATIVE:
            pytest.skip("the native key set (kvmanager/_keyset.c) is not built")
        assert cluster_index.KeySet is keyset.KeySet
        return keyset.KeySet
    monkeypatch.setattr(cluster_index, "KeySet", keyset.PyKeySet)
    monkeypatch.setattr(cluster_index, "keys_in", keyset.py_keys_in)
    return keyset.PyKeySet
