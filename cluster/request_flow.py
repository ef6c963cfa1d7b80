"""A request's way through failures: the handle's resilience paths as one small state machine.

``ClusterHandle.generate`` runs one ``Attempt`` at a time on a worker. When an
attempt ends without finishing the request, one transition of ``RequestFlow``
says what runs next:

* ``retry``: start again from the prompt (nothing streamed can be continued:
  no token yet, or n > 1, whose samples cannot be recomputed one by one). A
  caller that streams deltas has already passed on what the failed run made,
  so for it a request with several samples and streamed tokens ends with
  ``StreamNotResumable`` instead: starting again would repeat or contradict
  what its client has;
* ``resume``: recompute the prompt plus the tokens already streamed on another
  worker (n == 1), which takes those tokens as its own outputs (``max_tokens``,
  penalties, seeded draws and a grammar go on as if uninterrupted); the
  caller's output runs on;
* ``migrate``: the KV manager moved the request (preemption, a draining worker):
  continue on its target from the transferred KV, after the tokens streamed;
* ``fall_back``: the disaggregated path (prefill worker, KV transfer, decode
  worker) failed: continue colocated, resuming after what was streamed.

A worker's engine loop that fails (a bug, a device fault) ends every request
it held. Each goes on elsewhere like after a dead worker. The request that
made the loop fail is among them, so a request under which two engines failed
ends with ``RepeatedEngineFailure``: such a request stops at most two engines.
An engine is a worker's engine loop, one per incarnation: a request that comes
back to a restarted worker and fails it again has failed two engines, and one
that meets the same dead engine twice has failed one.

The flow decides; the handle acts (routes, streams, aborts, counts). The
flow owns the request's ``OutputAccumulator``, so every attempt continues the
same output, and its attempt count: a transition past ``max_attempts`` raises
``AttemptsExhausted``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.workers.outputs.accumulator import OutputAccumulator
from pagedserve.workers.outputs.detokenizer import DeltaTextDecoder
from pagedserve.workers.outputs.request_output import RequestOutput
from pagedserve.workers.actor.protocol import GenerateRequest, Migrated, OutputDelta, split_delta
from pagedserve.workers.lora.lora_request import LoRARequest
from pagedserve.workers.sample.sampling_params import SamplingParams

FIRST = "first"
DISAGGREGATED = "disaggregated"
RETRY = "retry"
RESUME = "resume"
MIGRATE = "migrate"
FALL_BACK = "fall_back"


class AttemptsExhausted(RuntimeError):
    """The request failed on more attempts than it may take."""


class StreamNotResumable(RuntimeError):
    """A streamed request with several samples lost its worker after tokens had been streamed."""


class RepeatedEngineFailure(RuntimeError):
    """A second engine loop failed while running the request."""


@dataclass
class Attempt:
    """One run of a request: what a worker is sent, and why this run."""

    kind: str
    number: int
    request: GenerateRequest
    target: str | None = None  # MIGRATE: the worker the KV manager chose

    @property
    def is_recompute(self) -> bool:
        """Whether this run computes again what an earlier run already had (prompt and tokens)."""
        return self.kind in (RETRY, RESUME, FALL_BACK)


class RequestFlow:
    """The attempts of one request (its sub-request ids are ``id``, ``id~2``, ``id~3``, ...)."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, priority: int, max_attempts: int, is_streamed: bool = False,
                 text_decoder: Callable[[], DeltaTextDecoder] | None = None,
                 lora_request: LoRARequest | None = None, token_by_token: bool = False) -> None:
        self.request_id = request_id
        self.lora_request = lora_request  # every attempt runs with the same adapter
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        # With a ``text_decoder`` the workers send token ids only (``detokenize`` off) and the
        # accumulator decodes their text.
        # A request with stop strings is decoded on its workers too: they find the stop strings.
        self.worker_params = (params if text_decoder is None or params.stop
                              else dataclasses.replace(params, detokenize=False))
        self.priority = priority
        self.max_attempts = max_attempts
        self.is_streamed = is_streamed  # the caller passes on deltas as they come
        self.accumulator = OutputAccumulator(request_id, prompt, prompt_token_ids, text_decoder)
        self.token_by_token = token_by_token   # an output per new token (``outputs``)
        self.num_attempts = 0
        # (worker, engine loop) pairs that failed under this request; an engine of unknown id is
        # its worker's only one
        self.failed_engines: set[tuple[str, str | None]] = set()

    def outputs(self, delta: OutputDelta) -> list[RequestOutput]:
        """The outputs a worker's ``delta`` makes: one, or with ``token_by_token`` one per new
        token (``split_delta``)."""
        if not self.token_by_token:
            return [self.accumulator.add(delta)]
        decodes_text = self.accumulator.text_decoder is not None   # the worker's text, if any, is not read
        return [self.accumulator.add(piece) for piece in split_delta(delta, drop_text=decodes_text)]

    # ---- the transitions -----------------------------------------------------------------------
    def start(self, is_disaggregated: bool = False) -> Attempt:
        """The first run: colocated, or prefill + decode workers."""
        return self._next(DISAGGREGATED if is_disaggregated else FIRST, self.prompt_token_ids)

    def after_failure(self) -> Attempt:
        """A worker failed (died, stalled, lost a transfer): resume where possible, else retry;
        ``StreamNotResumable`` when neither keeps what a streaming caller has passed on."""
        if self.can_resume:
            return self.resume()
        num_streamed = self.accumulator.num_tokens_all()
        if self.is_streamed and num_streamed:
            what = "a beam search" if self.params.use_beam_search else f"{self.params.n} samples"
            raise StreamNotResumable(
                f"the worker running request {self.request_id} failed after {num_streamed} tokens had been "
                f"streamed; {what} cannot be continued where they stopped, so the request ended: send it again")
        return self.retry()

    def after_engine_failure(self, worker_id: str, engine_id: str | None = None) -> Attempt:
        """The engine loop ``engine_id`` of ``worker_id`` failed (or had failed) while it held
        the request: go on as after a dead worker; once a second engine has failed under it,
        ``RepeatedEngineFailure`` (this request may be what makes engines fail)."""
        self.note_failed_engine(worker_id, engine_id)
        if len(self.failed_engines) > 1:
            workers = sorted({worker for worker, _ in self.failed_engines})
            raise RepeatedEngineFailure(
                f"{len(self.failed_engines)} engines (of workers {', '.join(workers)}) failed while running "
                f"request {self.request_id}; it may be what makes them fail, so it was not sent to another")
        return self.after_failure()

    def note_failed_engine(self, worker_id: str, engine_id: str | None = None) -> None:
        """Count an engine of ``worker_id`` as failed under this request (a path that goes on by
        other means, like the disaggregated fall-back)."""
        self.failed_engines.add((worker_id, engine_id))

    def retry(self) -> Attempt:
        """Start again from the prompt, forgetting what was streamed."""
        self.accumulator.reset()
        return self._next(RETRY, self.prompt_token_ids)

    def resume(self, kind: str = RESUME) -> Attempt:
        """Recompute prompt + streamed tokens elsewhere and continue after them (n == 1): the
        tokens go as outputs, so the run goes on exactly as the failed one would have."""
        if not self.can_resume:
            raise ValueError("only a single-sample request with streamed tokens can resume")
        return self._next(kind, self.prompt_token_ids, output_token_ids=self.accumulator.token_ids())

    def migrate(self, migrated: Migrated) -> Attempt:
        """Continue on ``migrated.target`` from the transferred KV, after the tokens streamed."""
        return self._next(MIGRATE, self.prompt_token_ids, target=migrated.target,
                          kv=[migrated.kv], output_token_ids=self.accumulator.token_ids())

    def fall_back(self) -> Attempt:
        """The disaggregated run failed: colocated, resuming after any streamed token."""
        if self.can_resume:
            return self.resume(FALL_BACK)
        return self._next(FALL_BACK, self.prompt_token_ids)

    # ---- state ------------------------------------------------------------------------------------
    @property
    def can_resume(self) -> bool:
        params = self.params
        return params.n == 1 and not params.use_beam_search and self.accumulator.num_tokens() > 0

    def _next(self, kind: str, token_ids: list[int], target: str | None = None, **continuation) -> Attempt:
        if self.num_attempts >= self.max_attempts:
            raise AttemptsExhausted(f"request {self.request_id} failed on {self.num_attempts} attempts")
        self.num_attempts += 1
        sub_id = self.request_id if self.num_attempts == 1 else f"{self.request_id}~{self.num_attempts}"
        request = GenerateRequest(sub_id, token_ids, self.worker_params, self.priority,
                                  lora_request=self.lora_request, **continuation)
        return Attempt(kind, self.num_attempts, request, target)


__all__ = ["Attempt", "AttemptsExhausted", "RepeatedEngineFailure", "RequestFlow", "StreamNotResumable"]
