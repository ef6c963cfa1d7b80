"""Python's garbage collector in a serving process: the start-up heap frozen, collections spaced, pauses counted.

CPython's cyclic collector runs with the process's GIL held. Two costs showed in
serving processes (the tiny Llama, 256 concurrent streams, CPU time inside collections):

- Full (generation 2) collections scan every tracked object. A worker holds about
  475,000 once it has started (torch, transformers, Ray, the model's modules), and
  serving promotes short-lived outputs into generation 2 fast enough to force a full
  collection every couple of seconds: 210-230 ms each, every stream of the process
  stalled meanwhile.
- Young collections, every 700 net allocations of container objects: a step's
  outputs and the channel message that carries them are thousands. The Serve replica
  spent 0.8 ms in each of about 1,000 such collections per 20 s, 1.4 s in all with
  its full ones, and they found 31 objects to free.

``prepare_serving_heap`` collects once, freezes what is alive (``gc.freeze``: the
permanent generation, which collections skip; what is made later is still
collected) as vLLM does after its engine starts and Ray Serve after a replica's,
and raises the young generation's threshold to ``YOUNG_GC_THRESHOLD``, so that a
step's transient objects are freed by reference counting before a collection ever
scans them (Serve does that for its proxy only). ``GCPauses`` times every
collection, so what is left stays visible (``Worker.stats``, the replica's ``/stats``).
The heap is unfrozen at exit (``atexit``), so that the interpreter's last collection
frees its cycles as it would without the freeze (frozen, Triton's compiler objects
outlive it, and nanobind reports them as "leaked instances" when the process exits).

Start-up itself pays for collections too: importing torch and transformers and building
the model make millions of objects, and every full collection scans the heap built so far.
A process that loads a model calls ``pause_collection_for_startup`` first; the collector
stays off until ``prepare_serving_heap``, which collects once and turns it back on. The
engine cores and the tensor-parallel ranks do (tiny Llama, 2-core CPU VM, runs alternating
with the collector on):

- building the engine in a fresh process: 0.89x the CPU (5.42 against 6.10 CPU-seconds,
  medians of eight);
- an engine core from its start to ready in a one-worker cluster: 3.6-4.6 against 4.4-5.5
  CPU-seconds (six each, in both orders);
- a tensor-parallel rank of a group of two: 3.8-4.5 against 4.7-5.7 (six each, both orders).
"""

from __future__ import annotations

import atexit
import gc
import logging
import time

logger = logging.getLogger(__name__)

NUM_GENERATIONS = 3
# Net allocations of tracked objects between young collections (CPython's default: 700).
YOUNG_GC_THRESHOLD = 10_000


def pause_collection_for_startup() -> None:
    """Turn the cyclic collector off until ``prepare_serving_heap``: call first thing in a
    process that imports torch and loads a model. What start-up leaves in reference cycles
    waits for that one collection (a process that fails to start exits)."""
    gc.disable()


def prepare_serving_heap(process: str) -> GCPauses:
    """Collect, freeze what is alive, space young collections out, and turn the collector on
    (``pause_collection_for_startup`` turned it off): call once, when start-up is done and
    before traffic. Returns the process's collection timer, started after the freeze's own
    collection."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_GC_THRESHOLD, older, oldest)
    gc.enable()
    frozen = gc.get_freeze_count()   # counted once: it walks the whole frozen heap (below)
    logger.info("%s: froze %d start-up objects out of garbage collection (%.0f ms); young collections "
                "every %d allocations", process, frozen, (time.perf_counter() - start) * 1e3,
                YOUNG_GC_THRESHOLD)
    return GCPauses(frozen).install()


class GCPauses:
    """Collections and their pause times per generation, from ``gc.callbacks``. Installed
    once per process; ``snapshot`` may be called from any thread.

    ``frozen_objects`` is the count ``prepare_serving_heap`` froze, kept rather than asked
    again: ``gc.get_freeze_count`` walks the frozen heap object by object with the GIL held,
    36 ms for a worker's 413,000 objects, and every stats poll (the dashboard's, each second)
    stalled each serving process that long."""

    def __init__(self, frozen_objects: int = 0) -> None:
        self.frozen_objects = frozen_objects
        self.collections = [0] * NUM_GENERATIONS
        self.pause_seconds = [0.0] * NUM_GENERATIONS
        self.max_pause_seconds = [0.0] * NUM_GENERATIONS
        self._started_at = 0.0

    def install(self) -> GCPauses:
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)
        return self

    def uninstall(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        # Runs inside the collection, which holds the GIL: nothing else runs meanwhile.
        if phase == "start":
            self._started_at = time.perf_counter()
            return
        generation = info["generation"]
        pause = time.perf_counter() - self._started_at
        self.collections[generation] += 1
        self.pause_seconds[generation] += pause
        if pause > self.max_pause_seconds[generation]:
            self.max_pause_seconds[generation] = pause

    def snapshot(self) -> dict:
        return {"enabled": gc.isenabled(), "frozen_objects": self.frozen_objects,
                "thresholds": list(gc.get_threshold()),
                "collections": list(self.collections),
                "pause_seconds": list(self.pause_seconds), "max_pause_seconds": list(self.max_pause_seconds)}
