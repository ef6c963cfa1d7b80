"""``KeySet`` (native and Python fallback) behaves exactly like a Python set of ints in [0, 2**64)."""

from __future__ import annotations

import pickle
import random
import struct
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.kvmanager import keyset

IMPLEMENTATIONS = [pytest.param((keyset.PyKeySet, keyset.py_keys_in), id="python")]
if keyset.NATIVE:
    IMPLEMENTATIONS.insert(0, pytest.param((keyset.KeySet, keyset.keys_in), id="native"))
else:
    IMPLEMENTATIONS.insert(0, pytest.param(None, id="native", marks=pytest.mark.skip("native key set not built")))

MAX = 2 ** 64 - 1
# 0 is the native table's empty-slot value (kept in a flag); the others are edges of the range.
SPECIAL = [0, 1, 2, MAX, MAX - 1, 2 ** 63, 2 ** 32, 0x9E3779B97F4A7C15]
keys = st.one_of(st.sampled_from(SPECIAL), st.integers(0, 64), st.integers(0, MAX))
key_lists = st.lists(keys, max_size=40)


def packed(ks: list[int]) -> bytes:
    return struct.pack(f"<{len(ks)}Q", *ks)


operations = st.lists(st.one_of(
    st.tuples(st.sampled_from(["add", "discard", "contains"]), keys),
    st.tuples(st.sampled_from(["add_packed", "discard_packed", "update", "difference_update", "intersection",
                               "intersection_dict", "keys_in"]), key_lists),
    st.tuples(st.sampled_from(["clear", "iterate", "rebuild"]), st.none()),
), max_size=120)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@settings(max_examples=300, deadline=None)
@given(ops=operations)
def test_keyset_behaves_like_a_set(impl, ops):
    cls, keys_in = impl
    ks, model = cls(), set()
    for op, arg in ops:
        if op == "add":
            ks.add(arg)
            model.add(arg)
        elif op == "discard":
            ks.discard(arg)
            model.discard(arg)
        elif op == "contains":
            assert (arg in ks) == (arg in model)
        elif op == "add_packed":
            ks.add_packed(packed(arg))
            model.update(arg)
        elif op == "discard_packed":
            ks.discard_packed(memoryview(b"x" + packed(arg))[1:])
            model.difference_update(arg)
        elif op == "update":
            ks.update(arg)
            model.update(arg)
        elif op == "difference_update":
            ks.difference_update(arg)
            model.difference_update(arg)
        elif op == "intersection":
            assert ks.intersection(arg) == model.intersection(arg)
        elif op == "intersection_dict":   # a dict larger or smaller than the set (two code paths)
            assert ks.intersection(dict.fromkeys(arg)) == model.intersection(arg)
        elif op == "keys_in":
            assert keys_in(packed(arg), ks) == [k for k in arg if k in model]
        elif op == "clear":
            ks.clear()
            model.clear()
        elif op == "iterate":
            listed = list(ks)
            assert len(listed) == len(model) and set(listed) == model
        else:
            ks = cls(list(ks))
        assert len(ks) == len(model)
        assert ks == model and not ks != model
        assert ks.to_set() == model
    for key in list(model) + SPECIAL:
        assert (key in ks) == (key in model)
    assert sorted(ks) == sorted(model)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_keyset_follows_a_set_through_growth_and_shrinking(impl):
    cls, _ = impl
    rng = random.Random(0)
    ks, model = cls(), set()
    pool = [rng.getrandbits(64) for _ in range(3000)] + list(range(2000)) + [k << 40 for k in range(500)]
    for round_ in range(40):
        batch = rng.sample(pool, rng.randrange(1, 800))
        if round_ % 3 == 2:
            ks.discard_packed(packed(batch))
            model.difference_update(batch)
        else:
            ks.add_packed(packed(batch))
            model.update(batch)
        assert len(ks) == len(model) and ks == model
    for key in pool:
        assert (key in ks) == (key in model)
    ks.discard_packed(packed(list(model)))
    assert len(ks) == 0 and list(ks) == [] and ks == set()
    assert all(key not in ks for key in pool)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_keyset_interface_details(impl):
    cls, keys_in = impl
    ks = cls([5, 0, MAX])
    assert pickle.loads(pickle.dumps(ks)) == ks == {0, 5, MAX} == cls(ks) and ks != {0, 5} and ks != cls([5])
    assert ks == frozenset({0, 5, MAX})
    with pytest.raises(TypeError):
        hash(ks)
    with pytest.raises(ValueError):
        ks.add_packed(b"\0" * 9)
    with pytest.raises(ValueError):
        keys_in(b"\0" * 7, {})
    assert keys_in(packed([5, 6, 0]), {0: 1, 5: 2}) == [5, 0]
    ks.update(ks)
    assert ks == {0, 5, MAX}
    with pytest.raises(RuntimeError):
        for key in ks:
            ks.add(key + 1)


@pytest.mark.skipif(not keyset.NATIVE, reason="native key set not built")
def test_native_keyset_refuses_what_is_not_a_key():
    ks = keyset.KeySet([1])
    for bad in (-1, 2 ** 64):
        with pytest.raises(OverflowError):
            ks.add(bad)
        with pytest.raises(OverflowError):
            ks.update([2, bad])
        assert bad not in ks
        ks.discard(bad)
    with pytest.raises(TypeError):
        ks.add("1")
    assert "1" not in ks and 1.5 not in ks and ks.intersection([-1, "x", 1]) == {1}
    assert len(ks) == 2   # 2 was added by update before the key it refused
    with pytest.raises(ValueError):
        ks.discard_packed(b"\0" * 4)


def test_without_the_extension_the_index_uses_python_sets_and_says_so_once():
    code = ("import sys; sys.modules['pagedserve.kvmanager._keyset'] = None\n"
            "from pagedserve.kvmanager import cluster_index, keyset\n"
            "from pagedserve.kvmanager.service import KVManagerService\n"
            "import importlib; importlib.import_module('pagedserve.kvmanager.keyset')\n"
            "assert not keyset.NATIVE and cluster_index.KeySet is keyset.PyKeySet\n"
            "assert type(cluster_index.ClusterIndex().workers.setdefault('w', cluster_index.WorkerView('w', {}))"
            ".keys['device']) is keyset.PyKeySet\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("the native key set is not built") == 1, result.stderr
