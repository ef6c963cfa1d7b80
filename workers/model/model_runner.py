"""Loads a transformers model and runs one flattened forward pass per step."""

from __future__ import annotations

import gc
import logging
from typing import Callable

import torch

from pagedserve.kernels import select_backend
from pagedserve.kernels.gpu_targets import check_dtype, check_shared_memory

from .attention import PagedAttentionMetadata, attention_context, register_paged_attention
from .block_tables import BlockTableRows
from .decode_graphs import DecodeGraphs, verify_graph_sizes
from .host_lists import int64_tensor, to_device
from .host_memory import retain_freed_host_memory
from .kv_cache import CacheShape, KVCache
from .merged_projections import merge_same_input_projections
from .model_head import ModelHead
from .model_input import ExecuteOutput, ModelInput, ScoreRequest, TokenScores, flatten
from .model_support import (check_kernel_support, check_model_class, check_servable_config,
                            context_limit, probe_attention, probe_forward)

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
           "half": torch.float16, "float": torch.float32}


def cuda_has_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes in bfloat16 natively.

    ``including_emulation=False``: by default torch also answers True for GPUs
    that only emulate bf16 (a T4, sm_75), where bf16 runs slowly or not at all
    in Triton kernels.
    """
    with torch.cuda.device(device):
        return torch.cuda.is_bf16_supported(including_emulation=False)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def describe_device(device: torch.device) -> str:
    """``cpu``, or ``cuda:0 (NVIDIA A10G, sm_86)``."""
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"{device} ({torch.cuda.get_device_name(device)}, sm_{major}{minor})"


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """The model and KV cache dtype. An explicit ``dtype`` always wins; None or "auto" picks
    per device: bfloat16 on a GPU with native bf16, float16 on other GPUs, float32 on CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if cuda_has_bf16(device) else torch.float16
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """'cuda' when asked for and present, else 'cpu'. None or 'auto' picks for you."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but CUDA is not available")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device}")
    return device


# Positions whose full-vocabulary logits are materialised at once when scoring.
SCORE_ROWS_PER_SLICE = 256


class ModelRunner:
    """A transformers decoder-only model whose attention reads the paged cache.

    Any model ``model_support`` accepts loads (it refuses the rest with
    ``UnsupportedModelError`` before or right after the weights load).
    ``execute`` takes the step's chunks (decode tokens and prefill chunks
    mixed), runs one varlen forward pass over all of them, and returns the
    float32 logits of the chunks that sample, in order (with any prompt
    logprobs the chunks asked for), through the model's own head (final
    soft-cap, logit scaling: see ``compute_logits``).

    ``load``, for one rank of a tensor-parallel group, builds the model in
    place of ``from_pretrained``: ``load(path, dtype, attn_implementation,
    trust_remote_code)`` returns that rank's part of it (``workers/tp/load.py``),
    on the CPU; every size read from the model after that (heads, KV heads,
    parameters) is the rank's.
    """

    def __init__(self, model: str, dtype=None, device=None, trust_remote_code: bool = False,
                 kernel_backend: str | None = None,
                 load: Callable[[str, torch.dtype, str, bool], torch.nn.Module] | None = None,
                 merge_projections: bool | None = None) -> None:
        from transformers import AutoModelForCausalLM

        self.device = resolve_device(device)
        if self.device.type == "cpu":
            retain_freed_host_memory()
        self.dtype = resolve_dtype(dtype, self.device)
        self.dtype_reason = ("engine.dtype" if dtype not in (None, "auto")
                             else f"auto for {describe_device(self.device)}")
        logger.info("model dtype %s on %s (%s)", dtype_name(self.dtype), self.device, self.dtype_reason)
        self.kernel_backend = kernel_backend
        # Triton kernels: compiled on CUDA (``uses_triton``), interpreted on the CPU.
        self.runs_triton = (kernel_backend or select_backend(self.device)) == "triton"
        self.uses_triton = self.device.type == "cuda" and self.runs_triton
        if self.uses_triton:  # before any weight is loaded: refuse at once
            check_dtype(torch.cuda.get_device_capability(self.device), self.dtype)
        config = check_servable_config(model, trust_remote_code)
        attn = register_paged_attention()
        if load is None:
            self.model = AutoModelForCausalLM.from_pretrained(
                model, dtype=self.dtype, attn_implementation=attn, trust_remote_code=trust_remote_code)
        else:
            self.model = load(model, self.dtype, attn, trust_remote_code)
        check_model_class(type(self.model), config.model_type)
        self.model.to(self.device).eval()
        self.config = config
        self.attention = probe_attention(self.model, config, self.device)
        check_kernel_support(self.attention, self.device, self.dtype, kernel_backend)
        logger.info("attention of %s", self.attention.describe())
        # q/k/v and gate/up as one matmul each, where the forward projects one input with them
        # (by default on CUDA only: see ``workers/model/merged_projections.py``).
        self.merged_projections: list[str] = []
        if merge_projections or (merge_projections is None and self.device.type == "cuda"):
            self.merged_projections = merge_same_input_projections(
                self.model, lambda: probe_forward(self.model, config, self.device))
            logger.info("projections merged into one matmul in %d modules", len(self.merged_projections))
        self.decoder = self.model.get_decoder()
        self.lm_head = self.model.get_output_embeddings()
        # The causal LM's head with its post-processing (final soft-cap, logit scaling).
        self.compute_logits = ModelHead(self.model, self.device)
        self.num_layers = config.num_hidden_layers
        self.num_heads = self.attention.num_heads
        self.num_kv_heads = self.attention.num_kv_heads
        self.head_dim = self.attention.head_dim
        self.vocab_size = config.vocab_size
        self.max_position_embeddings = getattr(config, "max_position_embeddings", 2048)
        # The longest context computed exactly (a RoPE variant may set it below the above).
        self.max_context_len, self.context_limit_reason = context_limit(config)
        self.num_parameters = sum(p.numel() for p in self.model.parameters())
        self.kv_cache: KVCache | None = None
        self.block_tables = BlockTableRows(self.device)
        self._kernels_checked: set[int] = set()  # block sizes whose kernels fit this GPU
        # Decode steps on static padded buffers (CUDA graphs on CUDA); None: every step eager.
        self.decode_graphs: DecodeGraphs | None = None
        # Verification steps of speculative decoding on static padded buffers, likewise.
        self.verify_graphs: DecodeGraphs | None = None
        # Return every token's last hidden states from eager forwards (an EAGLE head's input).
        self.keep_hidden_states = False

    def cache_shape(self, block_size: int) -> CacheShape:
        return CacheShape(self.num_layers, block_size, self.num_kv_heads, self.head_dim, self.dtype)

    def allocate_cache(self, block_size: int, num_device_blocks: int, num_host_blocks: int) -> KVCache:
        if self.uses_triton and block_size not in self._kernels_checked:
            # At load, not at the first request: kernels that cannot run on this GPU are refused here.
            check_shared_memory(torch.cuda.get_device_capability(self.device), self.dtype, self.head_dim,
                                self.num_heads // self.num_kv_heads, block_size)
            self._kernels_checked.add(block_size)
        self.kv_cache = KVCache(self.cache_shape(block_size), num_device_blocks, num_host_blocks,
                                self.device)
        return self.kv_cache

    def profile_peak_memory(self, num_tokens: int, block_size: int,
                            graph_sizes: list[int] | None = None, max_blocks_per_seq: int = 1,
                            torch_compile: bool = False, verify_query_len: int = 1) -> int:
        """Peak CUDA bytes of one forward pass over ``num_tokens`` prompt tokens, plus the
        memory pool of the CUDA graphs of ``graph_sizes`` (captured here, compiled with
        ``torch_compile``, then dropped), and with ``verify_query_len`` > 1 of the
        verification graphs (``enable_verify_graphs``).

        Runs against a throwaway cache just big enough for them; 0 off CUDA.
        """
        if self.device.type != "cuda":
            return 0
        num_blocks = -(-num_tokens // block_size)
        saved, self.kv_cache = self.kv_cache, None
        self.allocate_cache(block_size, num_blocks, 0)
        gc.collect()   # start-up's reference cycles (the collector is off while a core starts) out of the peak
        torch.cuda.reset_peak_memory_stats(self.device)
        row = self.block_tables.take_row("profile")
        try:
            self.execute(ModelInput([row], [0], [0] * num_tokens, [(row, list(range(num_blocks)), 0)],
                                    num_tokens=[num_tokens], logits_indexes=[0]))
        finally:
            self.block_tables.release("profile")
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        graph_bytes = 0
        if graph_sizes:
            graphs = self._try_graphs(graph_sizes, max_blocks_per_seq, torch_compile)
            graph_bytes = graphs.memory_bytes if graphs is not None else 0
            if graphs is not None and verify_query_len > 1:
                saved_graphs, self.decode_graphs = self.decode_graphs, graphs
                if self.enable_verify_graphs(verify_graph_sizes(graph_sizes, verify_query_len), max_blocks_per_seq,
                                             verify_query_len):
                    graph_bytes += self.verify_graphs.memory_bytes
                self.decode_graphs, self.verify_graphs = saved_graphs, None
            del graphs
        self.kv_cache = saved
        torch.cuda.empty_cache()
        return peak + graph_bytes

    def warm_up_kernels(self, max_blocks_per_seq: int) -> None:
        """Compile at load every kernel variant the steps launch, not in the first request
        that needs one: the block copy and swap kernels, and with Triton the attention and
        K/V write kernels of a mixed step and of decode steps, split (``max_blocks_per_seq``,
        the widest block table, allows it) and whole."""
        self._warm_up_block_copies()
        if self.runs_triton:
            self._warm_up_attention(max_blocks_per_seq)

    def _warm_up_block_copies(self) -> None:
        """Block 0 copied onto itself, and out to the host pool and back (the pools hold
        nothing yet)."""
        from pagedserve import kernels

        pairs = torch.tensor([[0, 0]], dtype=torch.int64, device=self.device)
        caches = self.kv_cache.device_caches
        kernels.copy_blocks([k for k, _ in caches], [v for _, v in caches], pairs)
        if self.kv_cache.num_host_blocks:
            k_cache, host_k = caches[0][0], self.kv_cache.host_caches[0][0]
            kernels.swap_blocks(k_cache, host_k, pairs.cpu())
            kernels.swap_blocks(host_k, k_cache, pairs.cpu())

    @torch.inference_mode()
    def _warm_up_attention(self, max_blocks_per_seq: int) -> None:
        """Forwards outside any CUDA graph, as a mixed step runs (compiled, if decode steps
        are), on padding (slot -1: no K/V is written): a mixed step (chunks of 2 and 1
        tokens, which read block 0), then one decoding sequence of no context with a table
        of one block (one split) and of ``max_blocks_per_seq`` (as many splits as a lone
        sequence gets)."""
        device = self.device

        def forward(chunk_lens: list[int], seq_lens: list[int], width: int) -> None:
            num_tokens = sum(chunk_lens)
            cu_seqlens = torch.zeros(len(chunk_lens) + 1, dtype=torch.int32)
            cu_seqlens[1:] = torch.tensor(chunk_lens).cumsum(0)
            meta = PagedAttentionMetadata(
                slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
                block_tables=torch.zeros((len(chunk_lens), width), dtype=torch.int32, device=device),
                cu_seqlens_q=cu_seqlens.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
                is_decode_only=max(chunk_lens) == 1, kv_caches=self.kv_cache.device_caches,
                backend=self.kernel_backend, plan_window=self.attention.max_sliding_window)
            positions = torch.cat([torch.arange(n) for n in chunk_lens]).to(device)
            self._stack(torch.zeros(num_tokens, dtype=torch.int64, device=device), positions, meta)

        forward([2, 1], [2, 1], 1)
        forward([1], [0], 1)
        forward([1], [0], max_blocks_per_seq)

    def enable_decode_graphs(self, sizes: list[int], max_blocks_per_seq: int, capture: bool = True,
                             torch_compile: bool = False, lora=None) -> bool:
        """Run decode steps of up to ``max(sizes)`` sequences padded on static buffers,
        captured as CUDA graphs when ``capture`` (CUDA only), the decoder stack compiled
        when ``torch_compile``; ``lora``: the model's ``LoRAContext`` (its static segments set,
        for graphs). A model whose forward cannot be compiled or captured says why in the
        log and runs without; returns whether the padded path is on."""
        if capture and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        if capture:
            self.decode_graphs = self._try_graphs(sizes, max_blocks_per_seq, torch_compile, lora)
        elif torch_compile:
            self.decode_graphs = self._try_compiled(sizes, max_blocks_per_seq)
        else:
            self.decode_graphs = DecodeGraphs(self, sizes, max_blocks_per_seq, capture=False, lora=lora)
        return self.decode_graphs is not None

    def enable_verify_graphs(self, sizes: list[int], max_blocks_per_seq: int, query_len: int,
                             capture: bool = True) -> bool:
        """Run verification steps of up to ``query_len`` tokens a sequence (the last token and
        its proposals) padded on static buffers, captured as CUDA graphs when ``capture``,
        into the decode graphs' memory pool and through their decoder stack (compiled, if
        it is): after ``enable_decode_graphs``. Returns whether the padded path is on."""
        decode = self.decode_graphs
        if decode is None:
            raise RuntimeError("enable_decode_graphs() must come first")
        try:
            self.verify_graphs = DecodeGraphs(self, sizes, max_blocks_per_seq, capture=capture and bool(decode.graphs),
                                              torch_compile=decode.is_compiled, query_len=query_len,
                                              decode_stack=decode.decode_stack, pool=decode.pool)
        except Exception as error:  # as for decode steps: a forward that cannot be captured
            logger.warning("verification steps run eagerly: the forward of %s cannot be captured with %d "
                           "tokens a sequence (%s: %s)", type(self.model).__name__, query_len,
                           type(error).__name__, _first_line(error))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.verify_graphs = None
        return self.verify_graphs is not None

    def _try_graphs(self, sizes: list[int], max_blocks_per_seq: int,
                    torch_compile: bool = False, lora=None) -> DecodeGraphs | None:
        if torch_compile:
            try:
                return DecodeGraphs(self, sizes, max_blocks_per_seq, capture=True, torch_compile=True)
            except Exception as error:
                logger.warning("decode steps run uncompiled: %s's forward failed to compile or to "
                               "capture compiled (%s: %s)", type(self.model).__name__,
                               type(error).__name__, _first_line(error))
                torch.cuda.synchronize(self.device)
        try:
            return DecodeGraphs(self, sizes, max_blocks_per_seq, capture=True, lora=lora)
        except Exception as error:  # a forward that syncs with the host or has dynamic shapes
            logger.warning("decode steps run eagerly: the forward of %s cannot be captured as a "
                           "CUDA graph (%s: %s)", type(self.model).__name__, type(error).__name__, error)
            torch.cuda.synchronize(self.device)
            return None

    def _try_compiled(self, sizes: list[int], max_blocks_per_seq: int) -> DecodeGraphs:
        try:
            return DecodeGraphs(self, sizes, max_blocks_per_seq, capture=False, torch_compile=True)
        except Exception as error:
            logger.warning("decode steps run uncompiled: %s's forward failed to compile (%s: %s)",
                           type(self.model).__name__, type(error).__name__, _first_line(error))
            return DecodeGraphs(self, sizes, max_blocks_per_seq, capture=False)

    @torch.inference_mode()
    def execute(self, model_input: ModelInput, pending_tokens: torch.Tensor | None = None) -> ExecuteOutput:
        """One forward pass over every chunk: the float32 logits of the chunks that
        sample ([num_sampling_chunks, vocab]) and the scores the chunks asked for.
        ``pending_tokens``: the running step's sampled ids, on the device, that
        ``model_input.pending`` entries take."""
        if self.kv_cache is None:
            raise RuntimeError("allocate_cache() must run before execute()")
        if model_input.pending and pending_tokens is None:
            raise ValueError("the step has pending tokens but no sampled ids to take them from")
        if not self.keep_hidden_states:
            for graphs in (self.decode_graphs, self.verify_graphs):
                if graphs is not None and graphs.can_run(model_input):
                    self.block_tables.write(model_input.table_updates)
                    return ExecuteOutput(graphs.run(model_input, pending_tokens), {})
        device = self.device
        batch = flatten(model_input, self.block_tables, self.kv_cache.shape.block_size)
        input_ids = batch.input_ids.to(device, non_blocking=True)
        if model_input.pending:
            positions, sources = zip(*model_input.pending)
            input_ids[to_device(int64_tensor(list(positions)), device)] = pending_tokens[
                to_device(int64_tensor(list(sources)), device)]
        meta = PagedAttentionMetadata(
            slot_mapping=batch.slot_mapping.to(device, non_blocking=True),
            block_tables=batch.block_tables,
            cu_seqlens_q=batch.cu_seqlens.to(device, non_blocking=True),
            seq_lens=batch.seq_lens.to(device, non_blocking=True),
            is_decode_only=model_input.is_decode_only,
            kv_caches=self.kv_cache.device_caches,
            backend=self.kernel_backend,
            # Every layer windowed: tables may hold -1 before the widest window (freed blocks).
            plan_window=self.attention.max_sliding_window,
        )
        hidden = self._stack(input_ids, batch.positions.to(device, non_blocking=True), meta)
        kept = hidden if self.keep_hidden_states else None
        scores = {}
        if model_input.scores:
            cu_seqlens = batch.cu_seqlens.tolist()
            for request in model_input.scores:
                i = request.index
                scores[i] = self._score(hidden[cu_seqlens[i]:cu_seqlens[i + 1]], request)
        if model_input.logits_indexes is None and model_input.is_decode_only:
            sampled = hidden
        elif model_input.logits_indexes == []:
            return ExecuteOutput(torch.empty((0, self.vocab_size), dtype=torch.float32, device=device), scores,
                                 kept)
        else:
            last_rows = batch.cu_seqlens[1:].to(torch.int64) - 1
            if model_input.logits_indexes is not None:
                last_rows = last_rows[model_input.logits_indexes]
            if model_input.num_logits is not None:
                last_rows = trailing_rows(last_rows, int64_tensor(model_input.num_logits))
            sampled = hidden.index_select(0, last_rows.to(device, non_blocking=True))
        return ExecuteOutput(self.compute_logits(sampled), scores, kept)

    def _stack(self, input_ids: torch.Tensor, positions: torch.Tensor,
               meta: PagedAttentionMetadata) -> torch.Tensor:
        """The decoder stack's last hidden states ``[tokens, hidden]``: through the compiled
        forward where decode steps have one (a mixed step runs it outside any CUDA graph,
        its token count a dynamic size), else eagerly."""
        graphs = self.decode_graphs
        if graphs is not None and graphs.is_compiled:
            with attention_context(meta):
                return graphs.decode_stack(input_ids, positions)
        return self.run_decoder(input_ids, positions, meta)

    def run_decoder(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """The transformers decoder's last hidden states ``[tokens, hidden]`` for a flat batch;
        ``meta`` is the step's ``PagedAttentionMetadata``, or ``FROM_CONTEXT`` in a compiled
        forward (the attention op then reads it from ``attention_context``)."""
        return self.decoder(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0),
                            paged_metadata=meta, use_cache=False).last_hidden_state[0]

    def release_block_table(self, seq_id: str) -> None:
        """The sequence left the running batch (finished, preempted, migrated): free its row."""
        self.block_tables.release(seq_id)

    def _score(self, hidden: torch.Tensor, request: ScoreRequest) -> TokenScores:
        """Logprobs of ``request.token_ids`` from the chunk's hidden states, a slice
        of positions at a time (full-vocabulary logits of a long prompt are large)."""
        targets = torch.tensor(request.token_ids, dtype=torch.int64, device=hidden.device)
        if len(targets) > hidden.shape[0]:
            raise ValueError(f"{len(targets)} tokens to score from a chunk of {hidden.shape[0]}")
        k = request.num_top_logprobs
        logprobs, top_ids, top_values = [], [], []
        for start in range(0, len(targets), SCORE_ROWS_PER_SLICE):
            end = min(start + SCORE_ROWS_PER_SLICE, len(targets))
            slice_logprobs = self.compute_logits(hidden[start:end]).log_softmax(dim=-1)
            logprobs.append(slice_logprobs.gather(1, targets[start:end, None]).squeeze(1))
            if k:
                values, ids = slice_logprobs.topk(min(k, self.vocab_size), dim=-1)
                top_ids.append(ids)
                top_values.append(values)
        num = len(targets)
        return TokenScores(
            torch.cat(logprobs).cpu(),
            torch.cat(top_ids).cpu() if k else torch.empty((num, 0), dtype=torch.int64),
            torch.cat(top_values).cpu() if k else torch.empty((num, 0)))


def trailing_rows(last_rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The rows ``last - count + 1 .. last`` of each (last row, count), in order (host tensors)."""
    total = int(counts.sum())
    ends = torch.cumsum(counts, 0)
    offsets = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(ends, counts, output_size=total)
    return torch.repeat_interleave(last_rows, counts, output_size=total) + offsets + 1


def _first_line(error: Exception) -> str:
    """A compiler error's first line (its full text can run to pages)."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""
