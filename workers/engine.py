"""The engine loop: schedule -> run -> postprocess, over the paged KV cache."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any, Callable

import torch

from pagedserve.kvmanager import PENDING_TOKEN, KVManager

from .beam_groups import BeamGroups
from .detokenizer import FINISH_STOP, check_stop
from .engine_options import EngineConfig
from .grammar import GrammarCompiler
from .input_batch import (BEAM, EXPORTS_KV, FORKS, GRAMMAR, MIN_TOKENS, PER_ROW, RANDOM, STOP_TOKEN_IDS, TEXT,
                          InputBatch)
from .kv_transfer import KVTransfer, check_compatible, export_kv, import_kv, read_header
from .host_lists import int64_tensor
from .model_runner import ModelInput, ScoreRequest, TokenScores
from .output_processor import OUTPUT_KINDS, EngineStep, OutputProcessor, SeqFinish, StepTokens, new_stream
from .request import Request, RequestOutput, Sequence
from .runners import build_runner
from .sampled_step import SampledStep, TokenReadback
from .sampler import SampleLogprobs, Sampler
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerOutput

logger = logging.getLogger(__name__)

GiB = 1 << 30


class LLMEngine:
    """Continuous batching over a paged KV cache for one model replica.

    ``add_request`` validates and queues; ``step`` runs one iteration (one
    in-process KV manager plan, one forward pass) and returns the outputs of
    the requests that produced tokens or finished. ``kv_manager`` defaults to
    a plain ``KVManager``; a cluster worker passes its ``LocalKVManager``
    (same code, plus KV events for the central manager). ``step_hooks`` run
    after every step, on the engine's thread (a worker publishes events there).
    """

    def __init__(self, config: EngineConfig, worker_id: str = "local",
                 kv_manager: KVManager | None = None, role: str = "mixed") -> None:
        from transformers import AutoTokenizer

        self.config = config
        self.worker_id = worker_id
        self.runner = build_runner(config)
        self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model,
                                                       trust_remote_code=config.trust_remote_code)
        max_len = config.max_model_len or self.runner.max_context_len
        if max_len > self.runner.max_context_len:
            raise ValueError(f"max_model_len {max_len} is longer than this model computes exactly: "
                             f"{self.runner.context_limit_reason}; use max_model_len <= "
                             f"{self.runner.max_context_len}")
        if max_len < self.runner.max_position_embeddings and config.max_model_len is None:
            logger.warning("max_model_len defaults to %d: %s", max_len, self.runner.context_limit_reason)
        self.max_model_len = max_len
        self.max_num_batched_tokens = config.max_num_batched_tokens or max(2048, max_len)
        self.eos_token_ids = self._eos_token_ids()
        num_device, num_host = self._size_pools()
        self.pool_config = config.pool_config(num_device, num_host, max_len, role=role,
                                              sliding_window=self._freeing_window(role))
        self.runner.allocate_cache(config.block_size, num_device, num_host)
        if self.runner.device.type == "cuda":
            self.runner.warm_up_block_copies()
        if self._uses_graphs or self._uses_compile:
            self.runner.enable_decode_graphs(config.graph_sizes(), -(-max_len // config.block_size),
                                             capture=self._uses_graphs, torch_compile=self._uses_compile)
        self.kv_manager = kv_manager if kv_manager is not None else KVManager()
        self.kv_manager.add_worker(worker_id, self.pool_config)
        self.step_hooks: list[Callable[[], None]] = []
        self.scheduler = Scheduler(self.kv_manager.step, worker_id, config.max_num_seqs,
                                   self.max_num_batched_tokens, config.scheduling_policy)
        self.batch = InputBatch(self.runner.block_tables, self.eos_token_ids, max_len)
        self.output_processor = OutputProcessor()
        # Overlapped scheduling: step n + 1 is planned and launched before step n's ids are read.
        self.async_scheduling = (config.async_scheduling if config.async_scheduling is not None
                                 else self.runner.device.type == "cuda")
        self._in_flight: SampledStep | None = None
        self.num_ended = 0   # sequences ended (finished, aborted, stopped): a step's samples of them are dropped
        self._readback = TokenReadback(self.runner.device, config.max_num_seqs)
        self.beam_groups = BeamGroups(self.scheduler, self.batch, self._new_sequence,
                                      lambda request: self.requests.pop(request.request_id, None),
                                      self.tokenizer, self.eos_token_ids, max_len)
        self.sampler = Sampler(config.seed)
        if config.seed is None:
            logger.info("sampler seed %d (fresh; set engine seed to reproduce unseeded requests)",
                        self.sampler.seed)
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        self.grammar_seconds = 0.0       # bitmask filling and matcher updates
        self.requests: dict[str, Request] = {}
        self._order = itertools.count()
        # What happened between steps (aborts), for the next step's output processing.
        self._pending = EngineStep()
        self.kv_exports: dict[str, KVTransfer] = {}
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.step_seconds = 0.0          # model-running steps only, see _record_step_time
        self.decode_step_seconds = 0.0   # steps where every sequence computed one token
        self.num_decode_steps = 0
        self.decode_kv_seconds = 0.0     # of decode steps' time, inside the KV manager's step
        self.hook_seconds = 0.0          # step hooks after every step (a worker's KV event flush)
        self.num_step_calls = 0

    # ---- set-up -------------------------------------------------------------------
    @property
    def _uses_graphs(self) -> bool:
        """Decode steps replay CUDA graphs: the default on CUDA (``enforce_eager`` turns it off)."""
        return self.runner.device.type == "cuda" and not self.config.enforce_eager

    @property
    def _uses_compile(self) -> bool:
        """Decode steps run through torch.compile: ``torch_compile``, else with CUDA graphs."""
        if self.config.torch_compile is not None:
            return self.config.torch_compile
        return self._uses_graphs

    def _eos_token_ids(self) -> list[int]:
        ids: list[int] = []
        generation = getattr(self.runner.model, "generation_config", None)
        for source in (getattr(generation, "eos_token_id", None), self.tokenizer.eos_token_id):
            if source is None:
                continue
            for token_id in ([source] if isinstance(source, int) else source):
                if token_id not in ids:
                    ids.append(token_id)
        return ids

    def _freeing_window(self, role: str) -> int | None:
        """The window out of which blocks are freed: the widest one when every layer has
        one. With local and global layers mixed, every block stays (said in the log), and
        on a prefill worker, which exports its prompts' KV whole."""
        attention = self.runner.attention
        if not attention.has_windows:
            return None
        if role == "prefill":
            logger.info("prefill worker: blocks out of the sliding window are kept (exported whole)")
            return None
        if not attention.is_all_windowed:
            global_layers = [i for i, w in enumerate(attention.sliding_windows) if w is None]
            logger.info("sliding windows on some layers, but layers %s attend globally: blocks out of "
                        "the windows are kept (they need the whole context)", global_layers)
            return None
        if self.config.allocation != "paged":
            logger.info("%s allocation keeps out-of-window blocks", self.config.allocation)
            return None
        window = attention.max_sliding_window
        logger.info("every layer is windowed (widest %d tokens): blocks out of the window are freed", window)
        return window

    def _size_pools(self) -> tuple[int, int]:
        """Device and host block counts: explicit count, memory budget, or GPU profile."""
        config = self.config
        shape = self.runner.cache_shape(config.block_size)
        num_host = shape.num_blocks_for(config.swap_space_gb * GiB)
        if config.num_device_blocks is not None:
            return config.num_device_blocks, num_host
        if config.kv_cache_memory_gb is not None:
            budget = config.kv_cache_memory_gb * GiB
        elif self.runner.device.type == "cuda":
            # The forward's peak and the CUDA graphs' pool come out of the budget first.
            peak = self.runner.profile_peak_memory(
                self.max_num_batched_tokens, config.block_size,
                config.graph_sizes() if self._uses_graphs else None,
                -(-self.max_model_len // config.block_size), self._uses_compile)
            total = torch.cuda.get_device_properties(self.runner.device).total_memory
            budget = total * config.gpu_memory_utilization - peak
        else:
            budget = 1 * GiB
        num_device = shape.num_blocks_for(budget)
        if num_device < -(-self.max_model_len // config.block_size):
            raise ValueError(f"the KV budget holds {num_device} blocks of {config.block_size} tokens, "
                             f"less than one sequence of max_model_len {self.max_model_len}; "
                             "raise kv_cache_memory_gb or lower max_model_len")
        return num_device, num_host

    # ---- requests -----------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int] | None,
                    params: SamplingParams | None = None, priority: int = 0,
                    prompt_token_ids: list[int] | None = None,
                    arrival_time: float | None = None, export_kv: bool = False,
                    kv_transfer: KVTransfer | None = None,
                    output_token_ids: list[int] | None = None, output_kind: str = "stream") -> Request:
        """Validate and queue a request. Raises ValueError, changing nothing, if it is bad.

        Disaggregated serving: ``export_kv`` keeps a copy of the prompt's KV
        when the first token is sampled (see ``take_kv_export``); a request
        with ``kv_transfer`` continues one prefilled elsewhere, whose
        ``output_token_ids`` were already sampled there. ``output_kind``
        "stream" returns an output at every step that has news for the
        request; "final" only its last one.
        """
        request = self.make_request(request_id, prompt, params, priority, prompt_token_ids,
                                    arrival_time=arrival_time, export_kv=export_kv,
                                    kv_transfer=kv_transfer, output_token_ids=output_token_ids,
                                    output_kind=output_kind)
        self.admit(request)
        return request

    def make_request(self, request_id: str, prompt: str | list[int] | None,
                     params: SamplingParams | None = None, priority: int = 0,
                     prompt_token_ids: list[int] | None = None,
                     arrival_time: float | None = None, export_kv: bool = False,
                     kv_transfer: KVTransfer | None = None,
                     output_token_ids: list[int] | None = None, output_kind: str = "stream") -> Request:
        """Validate and build a request (``add_request``'s arguments) without queueing it.

        Reads only what never changes after start-up (tokenizer, model limits,
        cache layout), so any thread may call it while another runs ``step``;
        ``admit`` then queues the result. Raises ValueError or TypeError if the
        request is bad.
        """
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority must be an int, got {priority!r}")
        if output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {OUTPUT_KINDS}, got {output_kind!r}")
        text, token_ids = self._tokenize(prompt, prompt_token_ids)
        if params.truncate_prompt_tokens is not None:
            keep = params.truncate_prompt_tokens
            keep = self.max_model_len - 1 if keep == -1 else keep
            if len(token_ids) > keep:
                text, token_ids = None, token_ids[-keep:]
        if not token_ids:
            raise ValueError("the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens; this model's maximum context "
                             f"is {self.max_model_len} tokens, including at least one output token")
        vocab = self.runner.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        num_imported = 0
        if kv_transfer is not None:
            meta = read_header(kv_transfer.header)
            all_tokens = token_ids + list(output_token_ids or [])
            check_compatible(self.runner.kv_cache, meta, all_tokens)
            num_imported = meta["num_tokens"]
            if params.n != 1 or params.use_beam_search or not 0 < num_imported < len(all_tokens):
                raise ValueError("a transferred request needs n == 1, no beam search and at least one "
                                 "token left to compute")
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.grammar_compiler.compile(params.structured_outputs)
        request = Request(request_id, text, token_ids, params, priority,
                          arrival_time if arrival_time is not None else time.time(), next(self._order))
        request.export_kv = export_kv
        request.is_migratable = params.n == 1 and not export_kv and not params.use_beam_search
        request.kv_transfer = kv_transfer
        request.grammar = grammar
        request.output_kind = output_kind
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]
        # Tokens sampled elsewhere were already streamed from there.
        seq = self._new_sequence(request, 0, list(token_ids), list(output_token_ids or []))
        for token_id in output_token_ids or []:
            seq.append_token(token_id)
        if seq.grammar is not None and not seq.grammar.accept_all(output_token_ids or []):
            # A resumed or migrated sequence replays its output through the grammar.
            raise ValueError("output_token_ids do not follow the request's structured_outputs "
                             f"grammar: {seq.grammar.error}")
        request.num_transferred_tokens = num_imported
        if params.use_beam_search:
            if output_token_ids or export_kv:
                raise ValueError("a beam search cannot continue sampled output or export its KV")
            self.beam_groups.start(request)
        return request

    def admit(self, request: Request) -> None:
        """Queue a request built by ``make_request``; ValueError if its id is in use."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.scheduler.add(request.seqs[0], request.num_transferred_tokens)

    def take_kv_export(self, request_id: str) -> KVTransfer | None:
        """The prompt KV kept for a request added with ``export_kv`` (once)."""
        return self.kv_exports.pop(request_id, None)

    def _tokenize(self, prompt, prompt_token_ids) -> tuple[str | None, list[int]]:
        if prompt_token_ids is not None:
            return None, list(prompt_token_ids)
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise TypeError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Structured outputs' compiler for this tokenizer (built on first use, by
        whichever thread validates the first structured request)."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.runner.vocab_size,
                                                         self.eos_token_ids)
        return self._grammar_compiler

    def _new_sequence(self, request: Request, index: int, token_ids: list[int],
                      streamed_token_ids: list[int] | None = None) -> Sequence:
        seq = Sequence(f"{request.request_id}#{index}", request, index, token_ids)
        seq.stream = new_stream(seq, self.tokenizer, self.eos_token_ids, self.max_model_len,
                                streamed_token_ids or [])
        if request.grammar is not None:
            seq.grammar = request.grammar.matcher()
        request.seqs.append(seq)
        return seq

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now; its blocks return to the pool. False if it is unknown."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        request.is_aborted = True
        self.num_ended += 1
        for seq in request.seqs:
            if not seq.is_finished:
                _drop_pending_tokens(seq)
                self.scheduler.finish(seq)
                self.batch.remove(seq)
                seq.finish_reason = "abort"
        self._pending.aborted.append(request)
        self._release_if_idle()
        return True

    def stop_sequences(self, seqs: list[Sequence]) -> None:
        """End sequences a stop string ended (the output processor found it in their
        text); those already ended are left alone."""
        for seq in seqs:
            if seq.is_finished:
                continue
            seq.finish_reason = FINISH_STOP
            self._end_sequence(seq)
        self._release_if_idle()

    def _end_sequence(self, seq: Sequence) -> None:
        self.num_ended += 1
        _drop_pending_tokens(seq)
        self.scheduler.finish(seq)
        self.batch.remove(seq)
        request = seq.request
        if request.is_finished:
            self.requests.pop(request.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_pending_outputs(self) -> bool:
        """Outputs that the next ``step`` returns even with nothing to run: aborts, and the
        samples of a step still running (overlapped scheduling)."""
        pending = self._pending
        return bool(pending.aborted or pending.migrated or pending.tokens) or self._in_flight is not None

    # ---- the loop -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run the model, sample, and report."""
        processed = self.output_processor.process(self.step_tokens())
        if processed.stopped:
            self.stop_sequences(processed.stopped)
        return processed.outputs

    def step_tokens(self) -> EngineStep:
        """``step`` without its output processing: what the step sampled and ended, for
        an ``OutputProcessor`` (on this thread or another); its ``stopped`` sequences
        must come back through ``stop_sequences``."""
        try:
            return self._step()
        finally:
            start = time.perf_counter()
            for hook in self.step_hooks:
                hook()
            self.hook_seconds += time.perf_counter() - start
            self.num_step_calls += 1

    def _step(self) -> EngineStep:
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        result, self._pending = self._pending, EngineStep()
        for seq in plan.preempted:  # migrated ones too
            self.batch.remove(seq)
        if plan.migrated and self._in_flight is not None:
            self._resolve(result)  # an export carries the sequence's tokens: all of them known
        for seq, target in plan.migrated:
            result.migrated.append(self._migrate(seq, target))
        # The copies run even when nothing is scheduled: a sequence that preempted
        # itself by swapping still needs its KV on the host.
        kv = plan.kv
        self.runner.kv_cache.execute_copies(kv.swap_out, kv.swap_in, kv.copy_on_write)
        if plan.is_empty or not plan.scheduled:
            if plan.is_empty and self.scheduler.num_unfinished and not kv.preempted and not self.scheduler.running:
                self._check_can_progress()
                result.aborted.extend(self._pending.aborted)
                self._pending.aborted.clear()
            if self._in_flight is not None:
                self._resolve(result)
            return result
        self.num_steps += 1
        model_input, sampling_seqs, sampling_rows, scored, first_samples = self._prepare(plan)
        in_flight = self._in_flight
        execute_output = self.runner.execute(model_input, in_flight.token_tensor if in_flight else None)
        for index, scores in execute_output.scores.items():
            seq, first_position = scored[index]
            self._add_prompt_logprobs(seq.request, first_position, scores)
        if sampling_seqs:
            sampled = self._sample(sampling_seqs, sampling_rows, execute_output.logits, first_samples, result)
            previous = self._in_flight
            if not sampled.seqs:
                self._release_if_idle()  # every row was a beam, taken by its group
            elif sampled.token_ids is None:
                self._launch(sampled)
            else:
                self._finish(sampled, result)
            if previous is not None:
                # Its ids are ready (this step is queued behind it). Sequences it ends drop the
                # pending token the launch just gave them.
                self._resolve(result, previous)
        elif self._in_flight is not None:
            self._resolve(result)
        self._record_step_time(start, model_input.is_decode_only)
        return result

    def _prepare(self, plan: SchedulerOutput):
        """The forward's input from the plan: O(1) Python per sequence on a decode
        step (no per-sequence objects); a new row, a prefill chunk, prompt logprobs or
        imported KV take the longer path."""
        rows: list[int] = []
        starts: list[int] = []
        input_ids: list[int] = []
        updates: list[tuple[int, list[int], int]] = []
        num_tokens: list[int] | None = None
        logits_indexes: list[int] | None = None
        scores: list[ScoreRequest] = []
        scored: dict[int, tuple[Sequence, int]] = {}
        sampling_seqs: list[Sequence] = []
        sampling_rows: list[int] = []
        first_samples: list[Sequence] = []   # sequences that may sample their first token
        pending: list[tuple[int, int]] = []  # (input position, sampling row of the running step)
        for index, (seq, sched) in enumerate(plan.scheduled):
            row = seq.batch_row
            table = sched.block_table
            if row < 0:
                row = self.batch.add(seq)
                updates.append((row, table, 0))
                first_samples.append(seq)
                self._on_admitted(seq, sched)
            elif sched.first_changed_block < len(table):
                updates.append((row, table, sched.first_changed_block))
            rows.append(row)
            start = sched.start
            starts.append(start)
            tokens = seq.token_ids
            if sched.num_tokens == 1 and start + 1 == len(tokens):
                token = tokens[start]
                if token == PENDING_TOKEN:  # sampled by the step still running: its id is on the device
                    pending.append((len(input_ids), seq.pending_source))
                input_ids.append(token)
                sampling_seqs.append(seq)
                sampling_rows.append(row)
                if num_tokens is not None:
                    num_tokens.append(1)
                if logits_indexes is not None:
                    logits_indexes.append(index)
                continue
            # A prefill chunk (or a single token that does not sample).
            end = start + sched.num_tokens
            if sched.num_tokens != 1 and num_tokens is None:
                num_tokens = [1] * index
            if num_tokens is not None:
                num_tokens.append(sched.num_tokens)
            samples = end == len(tokens)
            if not samples and logits_indexes is None:
                logits_indexes = list(range(index))
            if samples:
                sampling_seqs.append(seq)
                sampling_rows.append(row)
                first_samples.append(seq)
                if logits_indexes is not None:
                    logits_indexes.append(index)
            input_ids.extend(tokens[start:end])
            request = seq.request
            if request.needs_prompt_logprobs and seq.sample_index == 0:
                # Position p scores token p + 1, up to the prompt's last token.
                scores.append(ScoreRequest(index, tokens[start + 1:min(end + 1, seq.num_prompt_tokens)],
                                           request.params.prompt_logprobs))
                scored[index] = (seq, start + 1)
        model_input = ModelInput(rows, starts, input_ids, updates, num_tokens, logits_indexes, scores or None,
                                 pending or None)
        return model_input, sampling_seqs, sampling_rows, scored, first_samples

    def _on_admitted(self, seq: Sequence, sched) -> None:
        """A sequence took a row (admitted, resumed or forked): its first-step bookkeeping."""
        metrics = seq.request.metrics
        if metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = time.time()
        metrics.num_cached_tokens = max(metrics.num_cached_tokens, sched.num_cached_tokens)
        if sched.num_imported_tokens:
            self._import_kv(seq, sched)

    @staticmethod
    def _add_prompt_logprobs(request: Request, first_position: int, scores: TokenScores) -> None:
        """Keep the scores of positions not yet known (a recomputed prompt repeats some)."""
        known = len(request.prompt_logprobs)
        if first_position > known:
            raise RuntimeError(f"request {request.request_id}: prompt logprobs from position "
                               f"{first_position}, but only {known} are known")
        logprobs = scores.logprobs.tolist()
        top_ids, top_values = scores.top_ids.tolist(), scores.top_logprobs.tolist()
        token_ids = request.prompt_token_ids
        for i in range(known - first_position, len(logprobs)):
            position = first_position + i
            request.prompt_logprobs.append(SampleLogprobs(
                token_ids[position], logprobs[i], list(zip(top_ids[i], top_values[i]))))

    def _record_step_time(self, start: float, is_decode_only: bool) -> None:
        """Wall time of a step that ran the model (KV planning included)."""
        elapsed = time.perf_counter() - start
        self.step_seconds += elapsed
        if is_decode_only:
            self.decode_step_seconds += elapsed
            self.decode_kv_seconds += self.scheduler.last_kv_seconds
            self.num_decode_steps += 1

    def _migrate(self, seq: Sequence, target: str) -> tuple[Sequence, tuple, str]:
        """Export a migrated sequence's KV (before this step reuses its blocks) and hand
        the request over: its last output carries the transfer and the target."""
        request = seq.request
        transfer = export_kv(self.runner.kv_cache, seq.block_table, seq.num_computed, seq.token_ids)
        seq.finish_reason = "migrated"
        self.requests.pop(request.request_id, None)
        return seq, (transfer.header, transfer.payload), target

    def _import_kv(self, seq: Sequence, sched) -> None:
        request = seq.request
        start = time.perf_counter()
        import_kv(self.runner.kv_cache, request.kv_transfer, sched.block_table)
        request.metrics.kv_transfer_bytes += request.kv_transfer.num_bytes
        request.metrics.kv_transfer_s += time.perf_counter() - start
        request.kv_transfer = None

    def _check_can_progress(self) -> None:
        """Nothing runs and nothing could be admitted: say why instead of spinning."""
        head = self.scheduler.waiting[0]
        need = -(-len(head.token_ids) // self.config.block_size)
        watermark = int(self.pool_config.watermark * self.pool_config.num_device_blocks)
        if need + watermark > self.pool_config.num_device_blocks:
            self.abort_request(head.request.request_id)
            logger.error("request %s needs %d blocks but the pool has %d; aborted",
                         head.request.request_id, need, self.pool_config.num_device_blocks)

    # ---- sampling and finishing ---------------------------------------------------------
    def _sample(self, seqs: list[Sequence], rows: list[int], logits: torch.Tensor,
                first_samples: list[Sequence], result: EngineStep) -> SampledStep:
        """Sample one token per sequence (n per sequence whose samples fork now). The
        parameters are gathered from the persistent batch; only rows flagged as needing
        more are visited one by one, and those need the running step's ids first. With
        overlapped scheduling and no such row, the ids stay on the device (``token_ids``
        None) for ``_launch``; otherwise they are read here."""
        num_ended = self.num_ended
        step_rows = self.batch.step_rows(seqs, rows)
        row_index, flags = step_rows.rows, step_rows.flags
        per_row = step_rows.per_row_positions
        if per_row and self._in_flight is not None:
            self._resolve(result)  # penalties, grammars and forks read the sequences' last tokens
        forked: list[tuple[Sequence, Sequence]] = []
        flag_values = None
        if per_row:
            flag_values = flags.tolist()
            if bool((flags & BEAM).any()):
                seqs, logits, row_index, flags = self._take_beam_rows(seqs, logits, row_index, flags,
                                                                      flag_values, result)
                flag_values = flags.tolist()
                per_row = [p for p, value in enumerate(flag_values) if value & PER_ROW]
            if any(flag_values[p] & FORKS for p in per_row):
                seqs, index = self._fork(seqs, flag_values, forked)
                index_tensor = torch.tensor(index, dtype=torch.int64)
                logits = logits[index_tensor.to(logits.device)]
                row_index, flags = row_index[index_tensor], flags[index_tensor]
                flag_values = flags.tolist()
                per_row = [p for p, value in enumerate(flag_values) if value & PER_ROW]
        sampled = SampledStep(seqs, row_index, flags, logits, first_samples, per_row=per_row,
                              flag_values=flag_values, forked=forked, num_ended=num_ended)
        if not per_row and not bool((flags & RANDOM).any()):
            sampled.token_tensor = self.sampler.greedy(logits)   # greedy, unconstrained: the common case
        elif not per_row:
            sampled.token_tensor = self.sampler.sample_tokens(logits, self.batch.sampling_batch(row_index))
        else:
            batch = self.batch.sampling_batch(row_index)
            for p in per_row:
                self.batch.add_per_row(batch, p, seqs[p], flag_values[p], self._banned_token_ids(seqs[p]))
            grammar_positions = [p for p in per_row if flag_values[p] & GRAMMAR]
            if grammar_positions:
                self._add_token_bitmasks(seqs, grammar_positions, batch)
            output = self.sampler.sample_batch(logits, batch)
            sampled.token_tensor, sampled.token_ids = output.token_tensor, output.token_ids
            sampled.logprobs = output.logprobs if batch.num_logprobs else None
        if sampled.token_ids is None and not self.async_scheduling:
            sampled.token_ids = sampled.token_tensor.tolist()
        return sampled

    def _launch(self, sampled: SampledStep) -> None:
        """Leave a step's ids on the device and go on: each sequence gets a pending token,
        which the next step computes from the device's copy and ``_resolve`` fills in. A
        sequence whose sample is the last it may have gets none: it ends with it."""
        seqs = sampled.seqs
        sampled.last = self.batch.count_samples(sampled.rows).nonzero().squeeze(1).tolist()
        positions = []
        for index, seq in enumerate(seqs):
            positions.append(len(seq.token_ids))
            seq.pending_source = index
            seq.token_ids.append(PENDING_TOKEN)
            seq.output_token_ids.append(PENDING_TOKEN)
        pending = seqs
        if sampled.last:
            for p in sampled.last:
                seqs[p].token_ids.pop()
                seqs[p].output_token_ids.pop()
                positions[p] = -1
            pending = [seq for seq, position in zip(seqs, positions) if position >= 0]
        self.scheduler.append_tokens(pending, [PENDING_TOKEN] * len(pending))
        sampled.positions = positions
        sampled.num_row_releases = self.batch.num_row_releases
        sampled.readback = self._readback.start(sampled.token_tensor)
        self._in_flight = sampled

    def _resolve(self, result: EngineStep, sampled: SampledStep | None = None) -> None:
        """Read a launched step's ids (the running one by default) and finish it: the
        pending tokens get their values (a sequence's last token is appended). Sequences
        that ended since the launch (a finish found meanwhile, an abort, a stop string)
        drop their sample."""
        if sampled is None:
            sampled, self._in_flight = self._in_flight, None
        sampled.token_ids, sampled.host_tokens = self._readback.read(sampled.readback)
        self._drop_ended(sampled)
        seqs, positions, last, token_ids = sampled.seqs, sampled.positions, sampled.last, sampled.token_ids
        resolved_seqs, resolved_ids = seqs, token_ids
        if last:
            resolved_seqs = [seq for seq, position in zip(seqs, positions) if position >= 0]
            resolved_ids = [t for t, position in zip(token_ids, positions) if position >= 0]
        for seq, position, token_id in zip(seqs, positions, token_ids):
            if position < 0:
                seq.token_ids.append(token_id)
                seq.output_token_ids.append(token_id)
            else:
                seq.token_ids[position] = token_id
                seq.output_token_ids[position - seq.num_prompt_tokens] = token_id
        self.scheduler.resolve_tokens(resolved_seqs, resolved_ids)
        self._finish(sampled, result, is_resolved=True)

    def _drop_ended(self, sampled: SampledStep) -> None:
        """Drop the samples of sequences that ended since the step was planned."""
        if self.num_ended != sampled.num_ended:
            kept = [p for p, seq in enumerate(sampled.seqs) if not seq.is_finished]
            if len(kept) < len(sampled.seqs):
                sampled.keep(kept)

    def _finish(self, sampled: SampledStep, result: EngineStep, is_resolved: bool = False) -> None:
        """Account for a step's samples: append them (unless resolved from pending tokens),
        find the sequences that end, and record both in ``result``. Per sequence this is
        two list appends; the finish checks are tensor ops on the persistent batch."""
        if not is_resolved:
            token_tensor = sampled.token_tensor
            sampled.host_tokens = (token_tensor if token_tensor.device.type == "cpu"
                                   else int64_tensor(sampled.token_ids))
            self._drop_ended(sampled)  # ended while the step's previous one was read
        seqs, token_ids, host_tokens = sampled.seqs, sampled.token_ids, sampled.host_tokens
        for parent, child in sampled.forked:
            self.scheduler.fork(parent, child)
        if not is_resolved:
            for seq, token_id in zip(seqs, token_ids):
                seq.token_ids.append(token_id)
                seq.output_token_ids.append(token_id)
            self.scheduler.append_tokens(seqs, token_ids)
        self.num_generated_tokens += len(seqs)
        rows, per_row = sampled.rows, sampled.per_row
        if is_resolved:
            candidates = set(sampled.last)   # counted at the launch
            if sampled.num_row_releases != self.batch.num_row_releases:
                # Rows were released since the launch: read only rows still held by the same
                # sequence; the others (preempted meanwhile) are checked one by one.
                held = [p for p, seq in enumerate(seqs) if seq.batch_row == int(rows[p])]
                candidates.update(p for p in range(len(seqs)) if seq_row_lost(seqs[p], int(rows[p])))
                index = torch.tensor(held, dtype=torch.int64)
                eos = self.batch.ends_on_eos(rows[index], host_tokens[index]).nonzero().squeeze(1).tolist()
                candidates.update(held[i] for i in eos)
            else:
                candidates.update(self.batch.ends_on_eos(rows, host_tokens).nonzero().squeeze(1).tolist())
        else:
            ends_now = self.batch.count_samples(rows) | self.batch.ends_on_eos(rows, host_tokens)
            candidates = ends_now.nonzero().squeeze(1).tolist()
        ends: dict[int, tuple[str, bool]] = {}
        if candidates:
            self._check_ends(seqs, sorted(candidates), ends)
        if per_row:
            self._per_row_after_sampling(seqs, token_ids, sampled.logprobs, per_row, sampled.flag_values, ends)
        now = time.time()
        for seq in sampled.first_samples:
            metrics = seq.request.metrics
            if metrics.first_token_time is None and seq.output_token_ids:
                metrics.first_token_time = now
        for parent, _ in sampled.forked:
            self.batch.refresh_flags(parent)
        tokens = StepTokens(seqs, token_ids, sampled.logprobs)
        for p, (reason, by_token) in ends.items():
            seq = seqs[p]
            seq.finish_reason = reason
            self._end_sequence(seq)
            tokens.finished.append(SeqFinish(seq, reason, by_token))
        text = sampled.flags & TEXT
        if not bool(text.any()):
            tokens.text_positions = []
        elif not bool(text.all()):
            tokens.text_positions = text.nonzero().squeeze(1).tolist()
        result.tokens.append(tokens)
        self._release_if_idle()

    def _take_beam_rows(self, seqs: list[Sequence], logits: torch.Tensor, row_index: torch.Tensor,
                        flags: torch.Tensor, flag_values: list[int], result: EngineStep):
        """Hand the beam-search rows to their groups (``BeamGroups``); the other rows'
        sequences, logits, batch rows and flags go on to sampling."""
        beam = [p for p, value in enumerate(flag_values) if value & BEAM]
        rest = [p for p, value in enumerate(flag_values) if not value & BEAM]
        index = torch.tensor(beam, dtype=torch.int64)
        result.final_outputs.extend(self.beam_groups.advance([seqs[p] for p in beam],
                                                             logits[index.to(logits.device)]))
        self.num_generated_tokens += len(beam)
        index = torch.tensor(rest, dtype=torch.int64)
        return [seqs[p] for p in rest], logits[index.to(logits.device)], row_index[index], flags[index]

    def _fork(self, seqs: list[Sequence], flag_values: list[int],
              forked: list[tuple[Sequence, Sequence]]) -> tuple[list[Sequence], list[int]]:
        """The first token of an n > 1 request: its n samples share the prompt's blocks
        and sample from the same logits row. Returns the sampling rows' sequences and,
        per row, the logits row it reads."""
        owners: list[Sequence] = []
        index: list[int] = []
        for p, seq in enumerate(seqs):
            owners.append(seq)
            index.append(p)
            request = seq.request
            if flag_values[p] & FORKS and len(request.seqs) == 1 and not seq.output_token_ids:
                for sample_index in range(1, request.params.n):
                    child = self._new_sequence(request, sample_index, list(seq.token_ids))
                    forked.append((seq, child))
                    owners.append(child)
                    index.append(p)
        return owners, index

    def _check_ends(self, seqs: list[Sequence], positions: list[int], ends: dict[int, tuple[str, bool]]) -> None:
        """``check_stop`` decides, for the candidates the batch's counters found (or
        sequences without a row), whether and why each ends."""
        eos, max_model_len = self.eos_token_ids, self.max_model_len
        for p in positions:
            seq = seqs[p]
            reason = check_stop(seq.request.params, seq.output_token_ids, eos, seq.num_prompt_tokens, max_model_len)
            if reason is not None:
                ends[p] = (reason, True)

    def _per_row_after_sampling(self, seqs: list[Sequence], token_ids: list[int],
                                logprobs: list[SampleLogprobs | None] | None, per_row: list[int],
                                flag_values: list[int], ends: dict[int, tuple[str, bool]]) -> None:
        """The per-row work that follows a token: stop token ids, logprobs, grammars, KV
        exports, min_tokens."""
        for p in per_row:
            seq, value = seqs[p], flag_values[p]
            request = seq.request
            if value & STOP_TOKEN_IDS and p not in ends and token_ids[p] in request.params.stop_token_ids:
                ends[p] = (FINISH_STOP, True)
            if logprobs is not None and logprobs[p] is not None:
                seq.logprobs.append(logprobs[p])
            if value & EXPORTS_KV and request.request_id not in self.kv_exports:
                self.kv_exports[request.request_id] = export_kv(
                    self.runner.kv_cache, seq.block_table, seq.num_computed, seq.token_ids)
            if value & GRAMMAR and p not in ends:
                reason = self._advance_grammar(seq, token_ids[p])
                if reason is not None:
                    ends[p] = (reason, False)
            if value & MIN_TOKENS and p not in ends:
                self.batch.refresh_flags(seq)

    def _banned_token_ids(self, seq: Sequence) -> list[int]:
        """EOS and stop tokens while fewer than ``min_tokens`` outputs exist."""
        params = seq.request.params
        if len(seq.output_token_ids) >= params.min_tokens:
            return []
        eos = [] if params.ignore_eos else self.eos_token_ids
        return [t for t in dict.fromkeys(eos + params.stop_token_ids) if t < self.runner.vocab_size]

    def _add_token_bitmasks(self, seqs: list[Sequence], positions: list[int], batch) -> None:
        """Fill the grammar bitmask of every constrained row (one batched call)."""
        start = time.perf_counter()
        compiler = self.grammar_compiler
        bitmask = compiler.allocate_bitmask(len(positions))
        compiler.fill_bitmask([seqs[p].grammar for p in positions], bitmask)
        batch.bitmask_rows, batch.bitmask = positions, bitmask
        self.grammar_seconds += time.perf_counter() - start

    def _advance_grammar(self, seq: Sequence, token_id: int) -> str | None:
        """Move the sequence's grammar past ``token_id``: the finish reason if that ends
        it (its grammar is complete: "stop"; the token broke it: "abort", which the mask
        rules out), else None."""
        start = time.perf_counter()
        is_ok = seq.grammar.accept(token_id)
        self.grammar_seconds += time.perf_counter() - start
        if not is_ok:
            logger.error("request %s: token %d rejected by its grammar (%s); aborting the sequence",
                         seq.request.request_id, token_id, seq.grammar.error)
            return "abort"
        return FINISH_STOP if seq.grammar.is_finished else None

    def _release_if_idle(self) -> None:
        """With no request left, hand the last finished blocks back now, not at the next step."""
        if not self.requests and self.scheduler.has_pending_changes:
            kv = self.scheduler.schedule().kv
            self.runner.kv_cache.execute_copies(kv.swap_out, kv.swap_in, kv.copy_on_write)

    # ---- introspection -------------------------------------------------------------------
    def stats(self, pool_stats: dict | None = None) -> dict:
        """Pool, cache and queue statistics, plain data. ``pool_stats``: this step's
        ``KVManager.stats`` when the caller already has it (it walks every block table)."""
        stats: dict[str, Any] = dict(pool_stats if pool_stats is not None
                                     else self.kv_manager.stats(self.worker_id))
        cache = self.runner.kv_cache
        stats.update({
            "num_waiting": len(self.scheduler.waiting),
            "num_running": len(self.scheduler.running),
            "num_preemptions_by_mode": dict(self.scheduler.num_preemptions),
            "swapped_out_bytes": cache.num_bytes_swapped_out,
            "swapped_in_bytes": cache.num_bytes_swapped_in,
            "num_steps": self.num_steps,
            "num_generated_tokens": self.num_generated_tokens,
            "mean_step_ms": 1e3 * self.step_seconds / self.num_steps if self.num_steps else 0.0,
            "num_decode_steps": self.num_decode_steps,
            "mean_decode_step_ms": (1e3 * self.decode_step_seconds / self.num_decode_steps
                                    if self.num_decode_steps else 0.0),
            "grammar_seconds": self.grammar_seconds,
            "step_seconds": self.step_seconds,
            # The KV share of steps: time in the KV manager's step, and in the step hooks.
            "kv_seconds": self.scheduler.kv_seconds,
            "decode_kv_seconds": self.decode_kv_seconds,
            "step_hook_seconds": self.hook_seconds,
            "num_step_calls": self.num_step_calls,
        })
        graphs = self.runner.decode_graphs
        if graphs is not None:
            stats.update({"num_cuda_graphs": len(graphs.graphs), "cuda_graph_memory_bytes": graphs.memory_bytes,
                          "num_padded_decode_steps": graphs.num_runs, "num_graph_replays": graphs.num_replays,
                          "num_padded_rows": graphs.num_padded_rows,
                          "decode_compiled": graphs.is_compiled})
        if self._grammar_compiler is not None:
            stats["num_grammars_compiled"] = self._grammar_compiler.num_compiled
            stats["num_grammar_cache_hits"] = self._grammar_compiler.num_cache_hits
        return stats

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; False (nothing changed) unless the engine is idle."""
        if self.requests or self.scheduler.num_unfinished:
            return False
        self._release_if_idle()
        return self.kv_manager.reset_prefix_cache(self.worker_id)

    def check_integrity(self) -> None:
        """The KV accounting holds, and only running sequences hold block-table rows."""
        self.kv_manager.check_integrity()
        self.batch.check(self.scheduler.running)

    def num_used_blocks(self) -> int:
        return self.kv_manager.num_used_blocks()

    def block_map(self, max_cells: int = 4096) -> dict:
        """This engine's pools block by block (see ``KVManager.block_map``)."""
        return self.kv_manager.block_map(self.worker_id, max_cells)

    def config_dict(self) -> dict:
        return self.config.model_dump()


def _drop_pending_tokens(seq: Sequence) -> None:
    """An ended sequence forgets the tokens a still-running step was computing for it."""
    while seq.output_token_ids and seq.output_token_ids[-1] == PENDING_TOKEN:
        seq.output_token_ids.pop()
        seq.token_ids.pop()


def seq_row_lost(seq: Sequence, row: int) -> bool:
    """The sequence no longer holds ``row``, the row it sampled from (preempted since)."""
    return seq.batch_row != row
