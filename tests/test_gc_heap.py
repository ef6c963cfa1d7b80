"""The serving processes' garbage-collector settings: start-up heap frozen, pauses counted."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

from pagedserve.workers.process.gc_heap import YOUNG_GC_THRESHOLD, GCPauses


def test_gc_pauses_count_each_generation_and_stop_when_uninstalled():
    pauses = GCPauses().install()
    try:
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
        snapshot = pauses.snapshot()
        assert snapshot["collections"][0] >= 1 and snapshot["collections"][2] >= 2
        assert all(p >= 0 for p in snapshot["pause_seconds"])
        assert 0 < snapshot["max_pause_seconds"][2] <= snapshot["pause_seconds"][2]
        assert snapshot["thresholds"] == list(gc.get_threshold())
    finally:
        pauses.uninstall()
    gc.collect(2)
    assert pauses.snapshot()["collections"][2] == snapshot["collections"][2]


def test_prepare_serving_heap_freezes_what_is_alive_and_still_collects_what_comes_later():
    """In a process of its own (it changes the collector for the rest of the process). A start-up
    runs with the collector off; ``prepare_serving_heap`` collects its cycles and turns it back
    on. The snapshot, which every stats poll takes, reads the frozen count kept at the freeze."""
    script = textwrap.dedent("""
        import gc, weakref
        from pagedserve.workers.process.gc_heap import (YOUNG_GC_THRESHOLD, pause_collection_for_startup,
                                                         prepare_serving_heap)

        class Node:
            pass

        pause_collection_for_startup()               # as a process that loads a model starts
        start_up_cycle = Node()
        start_up_cycle.self = start_up_cycle
        start_up_ref = weakref.ref(start_up_cycle)
        del start_up_cycle
        alive = [Node() for _ in range(100_000)]     # far past the young threshold: nothing is collected
        assert not gc.isenabled() and start_up_ref() is not None
        pauses = prepare_serving_heap("test")
        assert gc.isenabled() and pauses.snapshot()["enabled"] is True
        assert start_up_ref() is None                # start-up's cycles went in its one collection
        frozen = gc.get_freeze_count()

        def walks_the_frozen_heap():   # object by object, with the GIL held: 36 ms in a worker
            raise AssertionError("a stats snapshot counted the frozen heap again")

        gc.get_freeze_count = walks_the_frozen_heap
        assert frozen >= 100_000 and pauses.snapshot()["frozen_objects"] == frozen, frozen
        assert gc.get_threshold()[0] == YOUNG_GC_THRESHOLD
        assert len(gc.get_objects()) < frozen / 10     # the frozen heap is out of every generation
        cycle = Node()
        cycle.self = cycle                             # garbage only the collector can free
        ref = weakref.ref(cycle)
        del cycle
        gc.collect()
        assert ref() is None and pauses.snapshot()["collections"][2] == 1
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
    assert YOUNG_GC_THRESHOLD > gc.get_threshold()[0]   # this process is left as it was


def test_the_frozen_heap_is_collected_as_the_process_exits():
    """A cycle frozen at start-up is freed by the interpreter's last collection, as it would be
    without the freeze. Frozen, Triton's compiler objects outlived it, and every serving process
    that had imported Triton printed nanobind's "leaked instances" report as it exited."""
    script = textwrap.dedent("""
        import importlib.util
        from pagedserve.workers.process.gc_heap import pause_collection_for_startup, prepare_serving_heap

        class Finalised:
            def __del__(self):
                print("finalised", flush=True)

        pause_collection_for_startup()
        if importlib.util.find_spec("triton") is not None:
            import triton  # noqa: F401
        start_up_cycle = Finalised()
        start_up_cycle.self = start_up_cycle
        alive = start_up_cycle                       # alive when the heap is frozen
        prepare_serving_heap("test")
        del alive, start_up_cycle                    # garbage only a collection of the frozen heap can free
        print("exiting", flush=True)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.split() == ["exiting", "finalised"], result.stdout + result.stderr
    assert "leaked" not in result.stderr, result.stderr


def test_the_proxy_ingress_spaces_serves_proxy_collections_unless_told_otherwise(monkeypatch):
    from pagedserve.cluster.serving import ingress

    monkeypatch.delenv(ingress.PROXY_GC_THRESHOLD_ENV, raising=False)
    ingress.prepare("proxy")
    assert os.environ[ingress.PROXY_GC_THRESHOLD_ENV] == str(YOUNG_GC_THRESHOLD)
    monkeypatch.setenv(ingress.PROXY_GC_THRESHOLD_ENV, "2000")
    ingress.prepare("proxy")
    assert os.environ[ingress.PROXY_GC_THRESHOLD_ENV] == "2000"
