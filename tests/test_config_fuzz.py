"""Config fuzzing: hypothesis-made YAML documents and ``--set`` overrides through ``load_config``.

Whatever goes in, ``load_config`` returns a valid ``ClusterConfig`` or raises
``ConfigError`` (a ``ValueError``) whose message names the offending key
path; no other exception type escapes. Short form by default, about 20x the
examples under ``--long-form``. Set ``PAGEDSERVE_CONFIG_FUZZ_REPORT=FILE`` to
write the outcome counts as JSON.
"""

from __future__ import annotations

import collections
import json
import math
import os
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.cluster.config import ClusterConfig, ConfigError, load_config

pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(600)]

NUM_EXAMPLES = 150
LONG_FORM_FACTOR = 20
OUTCOMES: collections.Counter = collections.Counter()


@pytest.fixture(scope="module", autouse=True)
def outcome_report():
    yield
    path = os.environ.get("PAGEDSERVE_CONFIG_FUZZ_REPORT")
    if path:
        Path(path).write_text(json.dumps(dict(OUTCOMES), indent=2, sort_keys=True))

SECTIONS = {
    "model": ["path", "revision", "download_dir", "arch", "size", "seed", "name"],
    "engine": ["dtype", "device", "block_size", "num_device_blocks", "kv_cache_memory_gb",
               "gpu_memory_utilization", "swap_space_gb", "enable_prefix_caching", "preemption_mode",
               "max_num_seqs", "max_num_batched_tokens", "max_model_len", "scheduling_policy",
               "allocation", "watermark", "seed", "kernel_backend"],
    "router": ["policy", "prefix_weight", "max_kv_utilization", "max_queue_per_worker"],
    "server": ["host", "port", "grpc_port", "api_key", "metrics_require_api_key", "log_requests", "limits"],
    "server.limits": ["max_request_body_bytes", "max_n", "max_stop_strings", "max_queued_requests",
                      "max_requests_per_client", "request_timeout_s", "stream_idle_timeout_s",
                      "body_read_timeout_s"],
    "workers.0": ["role", "count", "autoscaling", "num_cpus", "num_gpus", "resources", "engine"],
    "workers.0.autoscaling": ["min_replicas", "max_replicas", "target_ongoing_requests", "upscale_delay_s",
                              "downscale_delay_s", "look_back_period_s"],
}
TOP_KEYS = ["model", "engine", "workers", "router", "server", "kv_manager_num_cpus", "step_timeout_s",
            "health_check_period_s", "worker_ready_timeout_s"]
KEY_PATHS = ([f"{section}.{key}" for section, keys in SECTIONS.items() for key in keys] + TOP_KEYS)

WEIRD_TEXT = st.sampled_from(["", " ", "\x00", "\ud800", "🦙", "é", "\u202e", "a" * 5000, "0.0.0.0", "-1",
                              "1e309", ".inf", ".nan", "~", "null", "yes", "[1, 2", "{a: 1}", "!!python/object:os.system",
                              "&anchor", "*alias", "%", "@", "`", "|", ">", "key: value"])
SCALARS = st.one_of(
    st.none(), st.booleans(),
    st.integers(), st.integers(min_value=-2, max_value=70000),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20), WEIRD_TEXT,
)


def nested(leaves):
    return st.recursive(leaves, lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(st.sampled_from(KEY_PATHS + TOP_KEYS), st.text(max_size=8)),
                        children, max_size=4)), max_leaves=12)


VALUES = nested(SCALARS)
KEYS = st.one_of(st.sampled_from(KEY_PATHS), st.text(max_size=12),
                 st.lists(st.sampled_from(["server", "limits", "0", "workers", "engine", "", "x", "-1", "99"]),
                          min_size=1, max_size=5).map(".".join))


@st.composite
def documents(draw) -> dict:
    """A mapping built from real key paths with hostile values, plus random junk keys."""
    document: dict = {}
    for path in draw(st.lists(st.sampled_from(KEY_PATHS), max_size=6)):
        *parents, last = path.split(".")
        if parents[:2] == ["workers", "0"]:
            workers = document.setdefault("workers", [{}])
            node = workers[0] if isinstance(workers, list) and workers and isinstance(workers[0], dict) else {}
        else:
            node = document
            for part in parents:
                if not isinstance(node.get(part), dict):
                    node[part] = {}
                node = node[part]
        node[last] = draw(VALUES)
    if draw(st.booleans()):
        document.update(draw(st.dictionaries(st.text(max_size=10), VALUES, max_size=3)))
    return document


def overrides():
    raw_values = st.one_of(SCALARS.map(lambda v: yaml.safe_dump(v, default_flow_style=True).strip()
                                       .removesuffix("...").strip()),
                           st.text(max_size=30), WEIRD_TEXT)
    pair = st.tuples(KEYS, raw_values).map(lambda kv: f"{kv[0]}={kv[1]}")
    return st.lists(st.one_of(pair, st.text(max_size=20)), max_size=4)


def _examples(long_form: bool) -> int:
    return NUM_EXAMPLES * (LONG_FORM_FACTOR if long_form else 1)


def _check_outcome(path, override_list) -> None:
    try:
        config = load_config(path, override_list)
    except ConfigError as exc:
        assert str(exc).strip(), "a ConfigError must explain itself"
        OUTCOMES["ConfigError"] += 1
        return
    assert isinstance(config, ClusterConfig)
    OUTCOMES["valid ClusterConfig"] += 1
    _assert_finite(config.model_dump())


def _assert_finite(node) -> None:
    if isinstance(node, float):
        assert math.isfinite(node), node
    elif isinstance(node, dict):
        for value in node.values():
            _assert_finite(value)
    elif isinstance(node, list):
        for value in node:
            _assert_finite(value)


def test_hostile_yaml_documents(tmp_path, long_form):
    path = tmp_path / "fuzz.yaml"

    @settings(max_examples=_examples(long_form), deadline=None, suppress_health_check=list(HealthCheck))
    @given(document=documents(), override_list=overrides())
    def run(document, override_list):
        try:
            text = yaml.safe_dump(document, allow_unicode=True)
        except yaml.YAMLError:
            return
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        _check_outcome(path, override_list)

    run()


def test_hostile_yaml_text(tmp_path, long_form):
    path = tmp_path / "fuzz.yaml"
    fragments = st.sampled_from(["server:\n", "  limits:\n", "    max_n: ", "engine:\n  block_size: ",
                                 "workers:\n  - ", "count: ", "- ", "!!binary ", "!!python/name:os.system",
                                 "&a [*a]", "{", "}", "[", "]", ": ", "\n", "\t", "'", '"', "\\", "---\n",
                                 "...\n", "? ", "!", "%YAML 1.1\n", "\x00", "\ufeff", "\ud800", "1e999",
                                 ".nan", "0x10", "0o17", "1_000", "2001-12-14", "<<: *a\n"])
    texts = st.lists(st.one_of(fragments, st.text(max_size=6)), max_size=25).map("".join)

    @settings(max_examples=_examples(long_form), deadline=None, suppress_health_check=list(HealthCheck))
    @given(text=texts)
    def run(text):
        path.write_bytes(text.encode("utf-8", errors="surrogatepass"))
        _check_outcome(path, None)

    run()


def test_deep_nesting_is_a_config_error(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text("server:\n  limits: " + "[" * 20000 + "]" * 20000 + "\n")
    with pytest.raises(ConfigError):
        load_config(path)
    path.write_text("engine: " + "{a: " * 5000 + "1" + "}" * 5000 + "\n")
    with pytest.raises(ConfigError):
        load_config(path)


@pytest.mark.parametrize("override, key_path", [
    ("workers.5.count=2", "workers.5"),
    ("workers.x.count=2", "workers.x"),
    ("server.port.deep=1", "server.port"),
    ("engine.block_size=0", "engine.block_size"),
    ("server.limits.request_timeout_s=.nan", "server.limits.request_timeout_s"),
    ("engine.swap_space_gb=.inf", "engine.swap_space_gb"),
    ("=3", "empty key"),
    ("workers=7", "workers"),
    ("workers.0=7", "workers.0"),
])
def test_bad_overrides_name_the_key_path(override, key_path):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert key_path in str(info.value)
