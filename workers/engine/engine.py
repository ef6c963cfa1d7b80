"""The engine loop: schedule -> run -> postprocess, over the paged KV cache.

``LLMEngine`` coordinates: the ``Scheduler`` plans a step, ``prepare_step`` turns
the plan into the forward's input, the runner runs it, and the ``SamplingPipeline``
samples and finishes (one step later with overlapped scheduling); the
``OutputProcessor`` turns the step's tokens into outputs.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from typing import Any, Callable

import torch

from pagedserve.kvmanager import KVManager

from ..lora.lora_request import LoRARequest
from ..model.decode_graphs import verify_graph_sizes
from ..model.host_memory import check_pools_fit_host
from ..model.input_batch import InputBatch
from ..model.model_input import TokenScores
from ..model.model_support import check_max_model_len
from ..outputs.detokenizer import FINISH_STOP
from ..outputs.output_processor import OUTPUT_KINDS, EngineStep, OutputProcessor, new_stream
from ..outputs.request_output import RequestOutput, SampleLogprobs
from ..outputs.stream_batch import StreamTarget
from ..outputs.tokenizer_loading import load_tokenizer
from ..sample.grammar import GrammarCompiler
from ..sample.per_row_features import PerRowFeatures, bad_word_token_ids
from ..sample.sampled_step import TokenReadback
from ..sample.sampler import Sampler
from ..sample.sampling_params import SamplingParams
from ..sample.sampling_pipeline import SamplingPipeline
from ..spec_decode.draft_model import DraftModel
from ..spec_decode.eagle import EagleProposer
from ..spec_decode.ngram_proposer import NgramProposer
from ..spec_decode.speculator import Speculator
from .beam_groups import BeamGroups
from .engine_options import EngineConfig
from .kv_transfer import KVTransfer, check_compatible, export_kv, import_kv, read_header
from .prepared_step import prepare_step
from .request import Request, Sequence
from .runners import build_lora_manager, build_runner, enable_lora_pages
from .scheduler import Scheduler

logger = logging.getLogger(__name__)

GiB = 1 << 30


class LLMEngine:
    """Continuous batching over a paged KV cache for one model replica.

    ``add_request`` validates and queues; ``step`` runs one iteration (one
    in-process KV manager plan, one forward pass) and returns the outputs of
    the requests that produced tokens or finished. ``kv_manager`` defaults to
    a plain ``KVManager``; a cluster worker passes its ``LocalKVManager``
    (same code, plus KV events for the central manager). ``step_hooks`` run
    after every step, on the engine's thread. ``rank_launcher`` starts a tensor-parallel
    group's other ranks (default: as ``distributed_executor_backend`` says).
    """

    def __init__(self, config: EngineConfig, worker_id: str = "local",
                 kv_manager: KVManager | None = None, role: str = "mixed", rank_launcher=None) -> None:
        self.config = config
        self.worker_id = worker_id
        self.runner = build_runner(config, rank_launcher)
        self.lora = build_lora_manager(self.runner, config, self._adapters_in_use) if config.enable_lora else None
        self.tokenizer = load_tokenizer(config.tokenizer or config.model, config.trust_remote_code)
        max_len = check_max_model_len(config.max_model_len, self.runner.max_context_len,
                                      self.runner.context_limit_reason)
        if max_len < self.runner.max_position_embeddings and config.max_model_len is None:
            logger.warning("max_model_len defaults to %d: %s", max_len, self.runner.context_limit_reason)
        self.max_model_len = max_len
        self.max_num_batched_tokens = config.max_num_batched_tokens or max(2048, max_len)
        self.eos_token_ids = self._eos_token_ids()
        self.draft = self._draft_model(max_len)
        num_device, num_host = self._size_pools()
        self._check_host_memory(num_device, num_host)
        self.pool_config = config.pool_config(num_device, num_host, max_len, role=role,
                                              sliding_window=self._freeing_window(role))
        self.runner.allocate_cache(config.block_size, num_device, num_host)
        if self.draft is not None:
            self._check_draft_window(self.pool_config.sliding_window)
            self.draft.allocate_cache(config.block_size, num_device, num_host, config.max_num_seqs)
        self.kv_manager = kv_manager if kv_manager is not None else KVManager()
        self.kv_manager.add_worker(worker_id, self.pool_config)
        paged_lora = self.lora is not None and config.lora_paging == "unified"
        if paged_lora:   # before CUDA graphs capture the layers' page tables
            enable_lora_pages(self.runner, self.lora, self.kv_manager.block_manager(worker_id),
                              -(-max_len // config.block_size))
        max_blocks_per_seq = -(-max_len // config.block_size)
        if self._uses_graphs or self._uses_compile:
            lora = None
            if self.lora is not None and self._uses_graphs and config.tensor_parallel_size == 1:
                # every layer's slots now, and segments of fixed shapes, for the graphs to capture
                self.lora.layers.enable_static_segments(max(config.graph_sizes()))
                lora = self.lora.layers.context
            self.runner.enable_decode_graphs(config.graph_sizes(), max_blocks_per_seq,
                                             capture=self._uses_graphs, torch_compile=self._uses_compile, lora=lora)
            if self._uses_graphs and self._verify_query_len > 1 and self.runner.decode_graphs is not None:
                query_len = self._verify_query_len
                self.runner.enable_verify_graphs(verify_graph_sizes(config.graph_sizes(), query_len),
                                                 max_blocks_per_seq, query_len)
        if self.runner.device.type == "cuda" or self.runner.runs_triton:  # through the compiled forward, if any
            self.runner.warm_up_kernels(max_blocks_per_seq)
            if self.draft is not None:
                self.draft.warm_up(max_blocks_per_seq)
        self.step_hooks: list[Callable[[], None]] = []
        self.scheduler = Scheduler(self.kv_manager.step, worker_id, config.max_num_seqs,
                                   self.max_num_batched_tokens, config.scheduling_policy,
                                   max_loras=config.max_loras if config.enable_lora else None,
                                   adapter_pages=self.lora if paged_lora else None, block_size=config.block_size)
        self.batch = InputBatch(self.runner.block_tables, self.eos_token_ids, max_len)
        self.output_processor = OutputProcessor(config.stream_interval)
        self.beam_groups = BeamGroups(self.scheduler, self.batch, self._new_sequence,
                                      lambda request: self.requests.pop(request.request_id, None),
                                      self.tokenizer, self.eos_token_ids, max_len)
        self.sampler = Sampler(config.seed)
        if config.seed is None:
            logger.info("sampler seed %d (fresh; set engine seed to reproduce unseeded requests)",
                        self.sampler.seed)
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        self.per_row = PerRowFeatures(self.batch, self.runner, self.eos_token_ids, lambda: self.grammar_compiler)
        self.pipeline = SamplingPipeline(
            batch=self.batch, scheduler=self.scheduler, sampler=self.sampler, beam_groups=self.beam_groups,
            per_row=self.per_row, readback=TokenReadback(self.runner.device, config.max_num_seqs),
            eos_token_ids=self.eos_token_ids, max_model_len=max_len,
            # Overlapped scheduling: step n + 1 is planned and launched before step n's ids are read
            # (with speculation, only steps in which no sequence may propose; never with an EAGLE head).
            async_scheduling=(config.async_scheduling if config.async_scheduling is not None
                              else self.runner.device.type == "cuda" and not self._reads_hidden_states),
            new_sequence=self._new_sequence, end_sequence=self._end_sequence,
            release_if_idle=self._release_if_idle)
        self._overlaps = self.pipeline.async_scheduling
        self.speculator = self._speculator(max_len)
        self.requests: dict[str, Request] = {}
        self._order = itertools.count()
        # What happened between steps (aborts), for the next step's output processing.
        self._pending = EngineStep()
        self.num_steps = 0
        self.step_seconds = 0.0          # model-running steps only, see _record_step_time
        self.decode_step_seconds = 0.0   # steps where every sequence computed one token
        self.num_decode_steps = 0
        self.decode_kv_seconds = 0.0     # of decode steps' time, inside the KV manager's step
        self.hook_seconds = 0.0          # step hooks after every step (a worker's KV event flush)
        self.num_step_calls = 0
        self.num_scheduled_requests = 0  # requests scheduled at least once
        self.queue_seconds = 0.0         # their seconds from arrival to their first schedule, summed
        # The thread of the loop that drives this engine (an ``AsyncLLMEngine``), if one does:
        # stepping or changing the engine from any other thread would race it.
        self._driver: threading.Thread | None = None

    # ---- set-up -------------------------------------------------------------------
    @property
    def async_scheduling(self) -> bool:
        """Overlapped scheduling: a step's ids stay on the device while the next one is planned."""
        return self.pipeline.async_scheduling

    @property
    def _reads_hidden_states(self) -> bool:
        """An EAGLE head proposes: it reads every step's hidden states."""
        spec = self.config.speculative_config
        return spec is not None and spec.method in ("eagle", "eagle3")

    @property
    def _uses_graphs(self) -> bool:
        """Decode steps replay CUDA graphs: the default on CUDA (``enforce_eager``, an EAGLE
        head, which reads every step's hidden states, and LoRA without the Triton kernels, whose
        shapes follow each step's adapters, turn it off)."""
        lora_fits = self.lora is None or self.lora.layers.context.has_static_shapes
        return (self.runner.device.type == "cuda" and not self.config.enforce_eager and lora_fits
                and not self._reads_hidden_states)

    @property
    def _verify_query_len(self) -> int:
        """The query tokens a sequence of a verification step replayed as a CUDA graph has
        (its last token and up to ``num_speculative_tokens`` proposals); 1: such steps run
        eagerly (no speculation, or a model with sliding windows, whose tables may hold -1
        where a padded row would read)."""
        spec = self.config.speculative_config
        if spec is None or self.runner.attention.max_sliding_window is not None or self.lora is not None:
            return 1
        return spec.num_speculative_tokens + 1

    @property
    def _uses_compile(self) -> bool:
        """Decode steps run through torch.compile: ``torch_compile``, else with CUDA graphs
        (not with LoRA, whose steps run uncompiled)."""
        if self.config.torch_compile is not None:
            return self.config.torch_compile
        return self._uses_graphs and self.lora is None

    def _speculator(self, max_len: int) -> Speculator | None:
        """Speculative decoding's side of the engine, when ``speculative_config`` is set."""
        spec = self.config.speculative_config
        if spec is None:
            return None
        proposer = (self.draft if self.draft is not None else
                    NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max))
        logger.info("speculative decoding: %s, %d tokens a step", spec.method, spec.num_speculative_tokens)
        return Speculator(spec, proposer, batch=self.batch, scheduler=self.scheduler, sampler=self.sampler,
                          per_row=self.per_row, pipeline=self.pipeline, eos_token_ids=self.eos_token_ids,
                          max_model_len=max_len, end_sequence=self._end_sequence,
                          release_if_idle=self._release_if_idle)

    def _draft_model(self, max_len: int) -> DraftModel | EagleProposer | None:
        """The draft model (method "draft_model") or EAGLE head ("eagle", "eagle3") of
        ``speculative_config``, on the target's device and dtype (loaded before the pools are
        sized: its KV shares their blocks)."""
        spec = self.config.speculative_config
        if spec is None or spec.method not in ("draft_model", "eagle", "eagle3"):
            return None
        if spec.method in ("eagle", "eagle3"):
            draft = EagleProposer(spec.model, self.runner, spec.num_speculative_tokens, max_len, spec.method)
        else:
            draft = DraftModel(spec.model, self.runner, spec.num_speculative_tokens, max_len,
                               self.max_num_batched_tokens, self.config.trust_remote_code, self.config.kernel_backend)
        logger.info("%s %s (%.1fM parameters); its KV takes %d bytes a block beside the target's %d",
                    spec.method, spec.model, draft.num_parameters / 1e6,
                    draft.cache_shape(self.config.block_size).bytes_per_block,
                    self.runner.cache_shape(self.config.block_size).bytes_per_block)
        return draft

    def _check_draft_window(self, freeing_window: int | None) -> None:
        """Blocks freed out of the target's sliding window must be out of the draft's too."""
        if freeing_window is None:
            return
        self.draft.freeing_window = freeing_window
        attention = getattr(self.draft, "runner", None) and self.draft.runner.attention
        if attention is None or not attention.is_all_windowed or attention.max_sliding_window > freeing_window:
            raise ValueError(f"speculative_config.model {self.draft.model!r} attends beyond the target's "
                             f"sliding window ({freeing_window} tokens), whose older blocks are freed; "
                             "a draft model needs a window no wider than the target's (an EAGLE head has none)")

    def _execute_copies(self, kv) -> None:
        """A KV manager step's swaps and copies, in the target's cache and the draft's."""
        self.runner.kv_cache.execute_copies(kv.swap_out, kv.swap_in, kv.copy_on_write)
        if self.draft is not None:
            self.draft.execute_copies(kv.swap_out, kv.swap_in, kv.copy_on_write)

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

    def _lora_slot_bytes(self) -> int:
        """What LoRA slots may come to take on this device (they are allocated as adapters
        first target each layer, after the pools): kept out of a profiled KV budget."""
        if self.lora is None or self.config.lora_paging == "unified":
            return 0   # unified paging: adapters take pages of the KV pool itself
        num_bytes = self.lora.layers.max_slot_bytes
        logger.info("LoRA slots (max_loras %d, max_lora_rank %d) may take %.1f MiB; kept out of the KV budget",
                    self.lora.max_loras, self.lora.max_lora_rank, num_bytes / 2**20)
        return num_bytes

    def _bytes_per_block(self) -> int:
        """One KV block's bytes: the model's, plus a draft model's, whose KV shares the blocks."""
        bytes_per_block = self.runner.cache_shape(self.config.block_size).bytes_per_block
        if self.draft is not None:
            bytes_per_block += self.draft.cache_shape(self.config.block_size).bytes_per_block
        return bytes_per_block

    def _size_pools(self) -> tuple[int, int]:
        """Device and host block counts: explicit count, memory budget, or GPU profile."""
        config = self.config
        bytes_per_block = self._bytes_per_block()
        draft_bytes = 0   # a draft model's scratch comes off the budget
        if self.draft is not None:
            draft_bytes = self.draft.scratch_bytes(config.block_size, config.max_num_seqs)
        num_host = int(config.swap_space_gb * GiB // bytes_per_block)
        if config.num_device_blocks is not None:
            return config.num_device_blocks, num_host
        if config.kv_cache_memory_gb is not None:
            budget = config.kv_cache_memory_gb * GiB
        elif self.runner.device.type == "cuda":
            # The forward's peak and the CUDA graphs' pool come out of the budget first.
            peak = self.runner.profile_peak_memory(
                self.max_num_batched_tokens, config.block_size,
                config.graph_sizes() if self._uses_graphs else None,
                -(-self.max_model_len // config.block_size), self._uses_compile, self._verify_query_len)
            total = torch.cuda.get_device_properties(self.runner.device).total_memory
            budget = total * config.gpu_memory_utilization - peak - self._lora_slot_bytes()
        else:
            budget = 1 * GiB
        num_device = int(max(budget - draft_bytes, 0) // bytes_per_block)
        if num_device < -(-self.max_model_len // config.block_size):
            raise ValueError(f"the KV budget holds {num_device} blocks of {config.block_size} tokens, "
                             f"less than one sequence of max_model_len {self.max_model_len}; "
                             "raise kv_cache_memory_gb or lower max_model_len")
        return num_device, num_host

    def _check_host_memory(self, num_device: int, num_host: int) -> None:
        """Refuse pools that this host's memory cannot hold (``check_pools_fit_host``): the
        host pool, and the device pool where the device is the CPU."""
        config = self.config
        pools = [f"{num_host} host blocks: engine.swap_space_gb {config.swap_space_gb:g}"]
        num_blocks = num_host
        if self.runner.device.type == "cpu":
            budget = ("engine.num_device_blocks" if config.num_device_blocks is not None
                      else f"engine.kv_cache_memory_gb {config.kv_cache_memory_gb:g}"
                      if config.kv_cache_memory_gb is not None else "1 GiB, the CPU's default")
            pools.insert(0, f"{num_device} device blocks on the CPU: {budget}")
            num_blocks += num_device
        check_pools_fit_host(num_blocks * self._bytes_per_block(), "; ".join(pools))

    # ---- requests -----------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int] | None,
                    params: SamplingParams | None = None, priority: int = 0,
                    prompt_token_ids: list[int] | None = None,
                    arrival_time: float | None = None, export_kv: bool = False,
                    kv_transfer: KVTransfer | None = None,
                    output_token_ids: list[int] | None = None, output_kind: str = "stream",
                    stream_target: StreamTarget | None = None, lora_request: LoRARequest | None = None) -> Request:
        """Validate and queue a request. Raises ValueError, changing nothing, if it is bad.

        Disaggregated serving: ``export_kv`` keeps a copy of the prompt's KV
        when the first token is sampled (see ``take_kv_export``); a request
        with ``kv_transfer`` continues one prefilled elsewhere, whose
        ``output_token_ids`` were already sampled there. ``output_kind``
        "stream" returns an output at every step that has news for the
        request; "final" only its last one. With ``stream_target`` (streams only: an
        output channel's request, in the engine core), the request's news goes into its
        channel's ``StreamBatch`` rows instead of outputs (``OutputProcessor``).
        ``lora_request``: generate with that LoRA adapter (an engine with ``enable_lora``).
        """
        request = self.make_request(request_id, prompt, params, priority, prompt_token_ids,
                                    arrival_time=arrival_time, export_kv=export_kv,
                                    kv_transfer=kv_transfer, output_token_ids=output_token_ids,
                                    output_kind=output_kind, stream_target=stream_target,
                                    lora_request=lora_request)
        self.admit(request)
        return request

    def make_request(self, request_id: str, prompt: str | list[int] | None,
                     params: SamplingParams | None = None, priority: int = 0,
                     prompt_token_ids: list[int] | None = None,
                     arrival_time: float | None = None, export_kv: bool = False,
                     kv_transfer: KVTransfer | None = None,
                     output_token_ids: list[int] | None = None, output_kind: str = "stream",
                     stream_target: StreamTarget | None = None, lora_request: LoRARequest | None = None) -> Request:
        """Validate and build a request (``add_request``'s arguments) without queueing it.

        Reads only what never changes after start-up (tokenizer, model limits,
        cache layout) and reads adapters into the LoRA manager's host cache (under its
        lock), so any thread may call it while another runs ``step``;
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
        if stream_target is not None and output_kind != "stream":
            raise ValueError(f"a stream target takes a stream's rows; output_kind is {output_kind!r}")
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
        # The common case at C speed (a Python loop took 20 ms for 256 prompts of 570 tokens).
        if not (set(map(type, token_ids)) == {int} and 0 <= min(token_ids) and max(token_ids) < vocab):
            bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")
        params.check_token_ids(vocab)
        if params.use_beam_search and self.speculator is not None:
            raise ValueError("use_beam_search cannot be combined with speculative decoding "
                             "(this engine's speculative_config)")
        bad_words = bad_word_token_ids(self.tokenizer, params.bad_words) if params.bad_words else None
        outside = [t for word in bad_words or () for t in word if t >= vocab]
        if outside:
            raise ValueError(f"bad_words token ids must be in [0, {vocab}); got {outside[:5]}")
        num_imported = 0
        if kv_transfer is not None:
            meta = read_header(kv_transfer.header)
            all_tokens = token_ids + list(output_token_ids or [])
            check_compatible(self.runner.kv_cache, meta, all_tokens)
            num_imported = meta["num_tokens"]
            if params.n != 1 or params.use_beam_search or not 0 < num_imported < len(all_tokens):
                raise ValueError("a transferred request needs n == 1, no beam search and at least one "
                                 "token left to compute")
        if lora_request is not None:
            self._check_lora(lora_request)
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.grammar_compiler.compile(params.structured_outputs)
        request = Request(request_id, text, token_ids, params, priority,
                          arrival_time if arrival_time is not None else time.time(), next(self._order))
        request.export_kv = export_kv
        request.is_migratable = params.n == 1 and not export_kv and not params.use_beam_search
        request.lora_request = lora_request
        request.kv_transfer = kv_transfer
        request.grammar = grammar
        request.bad_words_token_ids = bad_words
        request.output_kind = output_kind
        request.stream_target = stream_target
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

    def _check_lora(self, lora_request: LoRARequest) -> None:
        """Refuse an adapter this engine cannot serve (``LoRAAdapterError`` names why); read
        it into host memory otherwise. A request that continues from transferred KV (migrated,
        or prefilled elsewhere) reads its adapter here if this engine has not yet."""
        if self.lora is None:
            raise ValueError(f"lora_request {getattr(lora_request, 'lora_name', lora_request)!r} needs an engine "
                             "with enable_lora=True")
        self.lora.add(lora_request)

    # ---- adapters by hand (vLLM's ``add_lora``, ``remove_lora``, ``list_loras``) ------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Check ``lora_request``'s adapter and read it into host memory before any request
        names it; ``LoRAAdapterError`` (a ValueError) names why it cannot be served."""
        self._check_lora(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget adapter ``lora_int_id`` (``LoRAManager.remove``); False if unknown or in use."""
        return self.lora is not None and self.lora.remove(lora_int_id)

    def list_loras(self) -> set[int]:
        """The ids of the adapters this engine knows."""
        return set() if self.lora is None else {request.lora_int_id for request in self.lora.list()}

    def admit(self, request: Request) -> None:
        """Queue a request built by ``make_request``; ValueError if its id is in use."""
        self._check_driver("adding a request")
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.scheduler.add(request.seqs[0], request.num_transferred_tokens)

    def take_kv_export(self, request_id: str) -> KVTransfer | None:
        """The prompt KV kept for a request added with ``export_kv`` (once)."""
        return self.per_row.kv_exports.pop(request_id, None)

    @property
    def num_generated_tokens(self) -> int:
        """Tokens sampled so far (beam-search tokens included)."""
        return self.pipeline.num_generated_tokens

    @property
    def grammar_seconds(self) -> float:
        """Time spent on structured outputs' bitmasks and matcher updates."""
        return self.per_row.grammar_seconds

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
        self._check_driver("aborting a request")
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        request.is_aborted = True
        for seq in request.seqs:
            if not seq.is_finished:
                self.pipeline.drop_pending(seq)
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
        """End ``seq`` (its ``finish_reason`` set): its row and blocks go back, and its
        request is forgotten once every sequence of it has ended."""
        self.pipeline.drop_pending(seq)
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
        return bool(pending.aborted or pending.migrated or pending.tokens) or self.pipeline.in_flight is not None

    # ---- who steps it ---------------------------------------------------------------
    def attach_driver(self, thread: threading.Thread) -> None:
        """From now on only ``thread`` (a loop such as ``AsyncLLMEngine``'s) steps this engine,
        adds and aborts requests: from any other thread they raise RuntimeError. An engine
        already driven by a live thread refuses a second."""
        driver = self._driver
        if driver is not None and driver is not thread and driver.is_alive():
            raise RuntimeError(f"this engine is already driven by thread {driver.name!r}; "
                               "one loop steps an engine")
        self._driver = thread

    def detach_driver(self, thread: threading.Thread) -> None:
        """``thread`` no longer drives this engine (its loop ended)."""
        if self._driver is thread:
            self._driver = None

    def _check_driver(self, what: str) -> None:
        driver = self._driver
        if driver is not None and driver is not threading.current_thread():
            raise RuntimeError(
                f"{what} from thread {threading.current_thread().name!r}: this engine is driven by "
                f"thread {driver.name!r} (an AsyncLLMEngine), which steps whatever the engine holds, "
                "so this would race it. Go through that AsyncLLMEngine (generate, abort, submit) "
                "or shut it down first")

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
        self._check_driver("a step")
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
        speculator = self.speculator
        if self.draft is not None:
            self.draft.before_step()
        if speculator is not None:
            # Proposals follow known tokens: none while a step's ids are still on the device.
            if self.pipeline.in_flight is None:
                speculator.propose(self.scheduler.running)
            # Overlap only a step after which no sequence may propose (the batch is at
            # disable_by_batch_size); otherwise read its ids at once, for the next proposals.
            self.pipeline.async_scheduling = self._overlaps and not speculator.may_propose(self.scheduler.running)
        plan = self.scheduler.schedule()
        if speculator is not None:
            speculator.take_plan(plan)
        result, self._pending = self._pending, EngineStep()
        for seq in plan.preempted:  # migrated ones too
            self.batch.remove(seq)
        if plan.migrated:
            self.pipeline.resolve_in_flight(result)  # an export carries the sequence's tokens: all of them known
        for seq, target in plan.migrated:
            result.migrated.append(self._migrate(seq, target))
        # The copies run even when nothing is scheduled: a sequence that preempted
        # itself by swapping still needs its KV on the host.
        kv = plan.kv
        self._execute_copies(kv)
        if plan.is_empty or not plan.scheduled:
            if plan.is_empty and self.scheduler.num_unfinished and not kv.preempted and not self.scheduler.running:
                self._check_can_progress()
                result.aborted.extend(self._pending.aborted)
                self._pending.aborted.clear()
            self.pipeline.resolve_in_flight(result)
            return result
        self.num_steps += 1
        prepared = prepare_step(plan, self.batch, self._on_admitted)
        with self._lora_step(plan, prepared.model_input):
            execute_output = self.runner.execute(prepared.model_input, self.pipeline.in_flight_tokens)
        if self.draft is not None:
            self.draft.after_forward([seq for seq, _ in plan.scheduled], prepared.model_input, execute_output)
        for index, scores in execute_output.scores.items():
            seq, first_position = prepared.scored[index]
            self._add_prompt_logprobs(seq.request, first_position, scores)
        if prepared.num_logits is not None:
            speculator.sample_step(prepared.sampling_seqs, prepared.sampling_rows, prepared.num_logits,
                                   execute_output.logits, prepared.first_samples, result)
        elif prepared.sampling_seqs:
            self.pipeline.sample_step(prepared.sampling_seqs, prepared.sampling_rows, execute_output.logits,
                                      prepared.first_samples, result)
        else:
            self.pipeline.resolve_in_flight(result)
        self._record_step_time(start, prepared.model_input.is_decode_only)
        return result

    def _lora_step(self, plan, model_input):
        """The forward's adapters, chunk by chunk (a no-op context without LoRA)."""
        if self.lora is None:
            return contextlib.nullcontext()
        return self.lora.run_step([seq.request.lora_request for seq, _ in plan.scheduled], model_input.num_tokens)

    def _adapters_in_use(self) -> set[int]:
        """The adapter ids of unfinished requests."""
        return {r.lora_request.lora_int_id for r in list(self.requests.values()) if r.lora_request is not None}

    def _on_admitted(self, seq: Sequence, sched) -> None:
        """A sequence took a row (admitted, resumed or forked): its first-step bookkeeping."""
        metrics = seq.request.metrics
        if metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = time.time()
            self.num_scheduled_requests += 1
            self.queue_seconds += metrics.first_scheduled_time - metrics.arrival_time
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

    def _release_if_idle(self) -> None:
        """With no request left, hand the last finished blocks back now, not at the next step."""
        if not self.requests and self.scheduler.has_pending_changes:
            self._execute_copies(self.scheduler.schedule().kv)

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
            # Steps whose sampled ids stayed on the device while the next was planned.
            "num_overlapped_steps": self.pipeline.num_launched_steps,
            "mean_decode_step_ms": (1e3 * self.decode_step_seconds / self.num_decode_steps
                                    if self.num_decode_steps else 0.0),
            "grammar_seconds": self.grammar_seconds,
            "step_seconds": self.step_seconds,
            # The KV share of steps: time in the KV manager's step, and in the step hooks.
            "kv_seconds": self.scheduler.kv_seconds,
            "decode_kv_seconds": self.decode_kv_seconds,
            "step_hook_seconds": self.hook_seconds,
            "num_step_calls": self.num_step_calls,
            # Requests' waits at this engine (its clock, from their arrival here), summed: to their
            # first schedule, and to their first token.
            "num_scheduled_requests": self.num_scheduled_requests,
            "queue_seconds": self.queue_seconds,
            "num_first_tokens": self.pipeline.num_first_tokens,
            "first_token_seconds": self.pipeline.first_token_seconds,
            # Modules whose q/k/v or gate/up projections run as one matmul (merge_projections).
            "num_merged_projections": len(getattr(self.runner, "merged_projections", ())),
        })
        if self.speculator is not None:
            stats.update(self.speculator.stats.as_dict())
        if self.draft is not None:
            stats.update(self.draft.stats())
        graphs = self.runner.decode_graphs
        if graphs is not None:
            stats.update({"num_cuda_graphs": len(graphs.graphs), "cuda_graph_memory_bytes": graphs.memory_bytes,
                          "num_padded_decode_steps": graphs.num_runs, "num_graph_replays": graphs.num_replays,
                          "num_padded_rows": graphs.num_padded_rows,
                          "decode_compiled": graphs.is_compiled})
        verify = self.runner.verify_graphs
        if verify is not None:
            stats.update({"num_verification_graphs": len(verify.graphs),
                          "num_padded_verification_steps": verify.num_runs,
                          "num_verification_graph_replays": verify.num_replays,
                          "num_padded_verification_rows": verify.num_padded_rows})
        if self.lora is not None:
            def names(seqs) -> list[str]:
                return sorted({s.request.lora_request.lora_name for s in seqs if s.request.lora_request})
            stats["lora"] = {**self.lora.stats(), "max_loras": self.lora.max_loras,
                             "max_cpu_loras": self.lora.max_cpu_loras,
                             # vLLM's lora_requests_info labels: the adapters of running and waiting requests.
                             "running_adapters": names(self.scheduler.running),
                             "waiting_adapters": names(self.scheduler.waiting)}
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

