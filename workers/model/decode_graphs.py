"""Decode steps on static, padded buffers: what CUDA graphs replay.

A decode-only step of B sequences runs at the smallest graph batch size P >= B. Its
inputs go into static device buffers through one pinned staging tensor and one
host-to-device copy; rows B..P are padding (sequence length 0: the attention kernels
read nothing and give zeros; slot -1: no K/V is written), and the logits of the first
B rows are returned. Block tables are gathered on the device into a static
``[P, max_blocks_per_seq]`` buffer, so every kernel's launch grid depends on P only.

With ``query_len`` Q > 1 the same holds for verification steps of speculative decoding:
each sequence has Q query rows (its last token and up to Q - 1 proposals, then padding:
token 0 at position 0, slot -1), its context length is its start plus Q, so that each real
row attends exactly the keys before it and itself, and the logits of the real rows are
returned, in order. The kernels read a padded row's keys up to Q - 1 positions past the
sequence's real ones: the static tables have the columns for them, and their entries are
the row's stale or zero block ids (never -1: no sliding window). Its outputs are dropped.

On CUDA each size's forward (the transformer stack, the LM head) is captured once as a
CUDA graph, largest first so that all share one memory pool, after warm-up runs on a
side stream (which also compile every Triton variant a size needs). A replay is one
launch. Elsewhere (CPU) the same padded forward runs eagerly: it is how the path is
tested without a GPU.

With ``torch_compile``, the decoder stack runs through ``torch.compile`` (dynamic batch size,
attention the opaque custom op of ``attention``), so the elementwise work around each
matmul fuses into few kernels; the warm-ups compile it before any capture. The runner's
mixed steps run the same compiled stack (``decode_stack``), their token count one more
value of the dynamic size: the compiled inputs of both are inference tensors at offset 0,
so that one compiled graph serves both. Dynamo keeps its compiled entries per function,
guarded on the instance: past its recompile limit (8: about four compiled engines in one
process) it runs the forward uncompiled, and says so in its own warning.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Protocol

import torch

from .attention import FROM_CONTEXT, PagedAttentionMetadata, attention_context
from .block_tables import BlockTableRows
from .host_lists import int64_tensor
from .kv_cache import KVCache
from .model_input import ModelInput

logger = logging.getLogger(__name__)

# Rows of the staging tensor: what one step copies to the device. Per token: ids, positions,
# slots; per sequence: context lengths, table rows. With one query a sequence, the last two say
# which ids are pending (overlapped scheduling): at which position, from which sampled row; with
# several (verification), the first says which rows' logits come back.
_IDS, _POSITIONS, _SLOTS, _LENS, _ROWS, _PENDING_AT, _PENDING_FROM = range(7)
_LOGIT_ROWS = _PENDING_AT


def default_graph_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 256 and every 16 beyond, up to ``max_num_seqs``."""
    sizes = [1, 2, 4, 8, *range(16, 257, 8), *range(272, max_num_seqs + 1, 16)]
    return sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})


# The most tokens a captured verification step computes (vLLM's default largest capture size).
MAX_VERIFY_GRAPH_TOKENS = 512


def verify_graph_sizes(sizes: list[int], query_len: int) -> list[int]:
    """The decode graph sizes whose verification steps (``query_len`` tokens a sequence) stay
    within ``MAX_VERIFY_GRAPH_TOKENS``, or the largest decode graph's rows if more."""
    budget = max(MAX_VERIFY_GRAPH_TOKENS, max(sizes))
    return [size for size in sizes if size * query_len <= budget] or [1]


class GraphedRunner(Protocol):
    """What the graphs need of their runner (``ModelRunner``): its cache, tables and device, and
    the decoder and head to capture."""

    device: torch.device
    kv_cache: KVCache
    block_tables: BlockTableRows
    kernel_backend: str | None
    attention: Any

    def run_decoder(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class DecodeGraphs:
    """Padded decode steps for a runner, captured as CUDA graphs when ``capture``.

    ``sizes`` are the padded batch sizes; ``max_blocks_per_seq`` the widest block table
    a sequence can have (``max_model_len`` over the block size); ``torch_compile``: the decoder
    stack runs compiled (``compile_backend``: torch.compile's backend), warmed up at every
    size here, so that nothing compiles inside a request. ``query_len``: the query rows of
    each sequence (1: decode steps; more: verification steps, see the module docstring).
    ``decode_stack``: the decoder stack's forward to run (another instance's, compiled once),
    ``pool``: the memory pool to capture into (another instance's graphs'). ``lora``: the
    model's ``LoRAContext``, whose static segments (if it has them) a padded step fills with
    its tokens' slots and runs on (a graph captures their fixed shapes).
    """

    def __init__(self, runner: GraphedRunner, sizes: list[int], max_blocks_per_seq: int,
                 capture: bool, torch_compile: bool = False, compile_backend: str = "inductor",
                 query_len: int = 1, decode_stack=None, pool=None, lora=None) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"graph batch sizes must be positive, got {sizes}")
        if query_len < 1:
            raise ValueError(f"query_len must be positive, got {query_len}")
        if lora is not None and query_len > 1:
            raise ValueError("verification steps with LoRA adapters run eagerly")
        if lora is not None and lora.static is not None and lora.static.max_tokens < max(sizes):
            raise ValueError(f"LoRA's static segments hold {lora.static.max_tokens} tokens, fewer than the "
                             f"largest graph size {max(sizes)}")
        self.lora = lora
        self.runner = runner
        self.sizes = sorted(set(sizes))
        self.max_size = self.sizes[-1]
        self.query_len = query_len
        self.block_size = runner.kv_cache.shape.block_size
        # A padded row reads up to query_len - 1 positions past its sequence's last.
        self.max_blocks_per_seq = max_blocks_per_seq + (-(-(query_len - 1) // self.block_size))
        device = runner.device
        self.device = device
        max_tokens = self.max_size * query_len
        # Inference tensors, like every input of an eager step: the compiled forward's inputs
        # then match in every step (dynamo guards on a tensor's dispatch keys).
        with torch.inference_mode():
            # Two staging tensors, alternating: a step never writes the one the step before it
            # may still be copying from (overlapped scheduling).
            self.stagings = [torch.zeros((7, max_tokens), dtype=torch.int64, pin_memory=device.type == "cuda")
                             for _ in range(2)]
            self.inputs = torch.zeros((7, max_tokens), dtype=torch.int64, device=device)
            self.block_tables = torch.zeros((self.max_size, self.max_blocks_per_seq), dtype=torch.int32,
                                            device=device)
            self.cu_seqlens = torch.arange(self.max_size + 1, dtype=torch.int32, device=device) * query_len
            # The positions where the forward reads them: a tensor of its own, so that the
            # compiled forward's inputs start at offset 0, as an eager step's do.
            self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        runner.block_tables.reserve_columns(self.max_blocks_per_seq)
        self.is_compiled = torch_compile
        # The decoder stack's forward on the static buffers, compiled or not.
        if decode_stack is not None:
            self.decode_stack = decode_stack
        else:
            self.decode_stack = (torch.compile(self._decode_eager, dynamic=True, backend=compile_backend)
                                 if torch_compile else self._decode_eager)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = pool
        self.memory_bytes = 0     # the graphs' memory pool, once captured (its growth, in a shared one)
        self.num_runs = 0         # padded steps, replayed or eager
        self.num_replays = 0
        self.num_padded_rows = 0  # padding sequences (and with query_len > 1, padding query rows)
        if capture:
            self._capture()
        elif torch_compile and decode_stack is None:
            self._warm_up()

    # ---- a step ----------------------------------------------------------------------------
    def padded_size(self, num_seqs: int) -> int | None:
        for size in self.sizes:
            if size >= num_seqs:
                return size
        return None

    def can_run(self, model_input: ModelInput) -> bool:
        """With one query a sequence: a decode-only step, every sequence sampling, no scores,
        within the sizes. With several: a verification step (every chunk a sequence's last
        token and its proposals, at most ``query_len`` tokens, with the logits of each), no
        pending ids."""
        if model_input.scores or model_input.logits_indexes is not None or not (
                0 < model_input.num_chunks <= self.max_size):
            return False
        if self.query_len == 1:
            return model_input.is_decode_only and model_input.num_logits is None
        num_tokens = model_input.num_tokens
        return (num_tokens is not None and model_input.num_logits == num_tokens and not model_input.pending
                and max(num_tokens) <= self.query_len)

    def run(self, model_input: ModelInput, pending_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The step's logits ``[num_seqs, vocab]`` (a view of a static buffer, valid until
        the next ``run``); with several queries a sequence, those of every real row, in order.
        The block tables' rows must already hold the step's updates; ``pending_tokens``
        holds the ids ``model_input.pending`` refers to."""
        if self.query_len > 1:
            return self._run_verification(model_input)
        num_seqs = model_input.num_chunks
        size = self.padded_size(num_seqs)
        rows = int64_tensor(model_input.rows)
        starts = int64_tensor(model_input.starts)
        block_size = self.block_size
        host_tables = self.runner.block_tables.host
        staging = self.stagings[self.num_runs % 2]
        pending = model_input.pending or []
        if pending:
            staging[_PENDING_AT:, :len(pending)] = int64_tensor([i for pair in pending for i in pair]).view(-1, 2).T
        staging[_IDS, :num_seqs] = int64_tensor(model_input.input_ids)
        staging[_POSITIONS, :num_seqs] = starts
        staging[_SLOTS, :num_seqs] = (host_tables[rows, starts // block_size].to(torch.int64) * block_size
                                      + starts % block_size)
        staging[_LENS, :num_seqs] = starts + 1
        staging[_ROWS, :num_seqs] = rows
        if size > num_seqs:
            staging[:, num_seqs:size] = 0
            staging[_SLOTS, num_seqs:size] = -1
        # The whole staging tensor (a few KiB): one contiguous copy from pinned memory.
        self.inputs.copy_(staging, non_blocking=True)
        if pending:
            ids = self.inputs[_IDS]
            ids.index_copy_(0, self.inputs[_PENDING_AT, :len(pending)],
                            pending_tokens.index_select(0, self.inputs[_PENDING_FROM, :len(pending)]))
        self._gather_tables(num_seqs)
        self.num_padded_rows += size - num_seqs
        lora = self.lora
        if lora is None or lora.static is None:
            return self._replay(size)[:num_seqs]
        with lora.using(lora.static.fill(lora.token_slots)):   # the step's own segments never built
            return self._replay(size)[:num_seqs]

    def _run_verification(self, model_input: ModelInput) -> torch.Tensor:
        """A verification step on the padded rows: sequence i's real tokens in its first
        rows, the logits of every real row back."""
        num_seqs, query_len = model_input.num_chunks, self.query_len
        size = self.padded_size(num_seqs)
        block_size = self.block_size
        num_tokens = int64_tensor(model_input.num_tokens)
        starts = int64_tensor(model_input.starts)
        rows = int64_tensor(model_input.rows)
        offsets = torch.arange(query_len, dtype=torch.int64)
        is_real = (offsets < num_tokens[:, None]).flatten()                     # [num_seqs * query_len]
        real_rows = is_real.nonzero().flatten()
        positions = (starts[:, None] + offsets).flatten()[real_rows]
        token_rows = rows.repeat_interleave(num_tokens, output_size=len(real_rows))
        staging = self.stagings[self.num_runs % 2]
        width = num_seqs * query_len
        staging[:_LENS, :size * query_len] = 0
        staging[_SLOTS, :size * query_len] = -1
        staging[_IDS, real_rows] = int64_tensor(model_input.input_ids)
        staging[_POSITIONS, real_rows] = positions
        staging[_SLOTS, real_rows] = (self.runner.block_tables.host[token_rows, positions // block_size]
                                      .to(torch.int64) * block_size + positions % block_size)
        staging[_LENS, :num_seqs] = starts + query_len
        staging[_ROWS, :num_seqs] = rows
        staging[_LENS, num_seqs:size] = query_len    # padding sequences: read block 0's first keys
        staging[_ROWS, num_seqs:size] = 0
        staging[_LOGIT_ROWS, :len(real_rows)] = real_rows
        self.inputs.copy_(staging, non_blocking=True)
        self._gather_tables(num_seqs)
        self.num_padded_rows += (size - num_seqs) + (width - len(real_rows))
        logits = self._replay(size)
        return logits.index_select(0, self.inputs[_LOGIT_ROWS, :len(real_rows)])

    def _gather_tables(self, num_seqs: int) -> None:
        source = self.runner.block_tables.source
        torch.index_select(source[:, :self.max_blocks_per_seq], 0, self.inputs[_ROWS, :num_seqs],
                           out=self.block_tables[:num_seqs])

    def _replay(self, size: int) -> torch.Tensor:
        """The padded forward of ``size`` sequences: its graph replayed, or run eagerly."""
        self.num_runs += 1
        graph = self.graphs.get(size)
        if graph is None:
            return self._forward(size)
        graph[0].replay()
        self.num_replays += 1
        return graph[1]

    def _forward(self, size: int) -> torch.Tensor:
        """The padded forward of ``size`` sequences, on the static buffers only (capturable)."""
        runner = self.runner
        inputs = self.inputs
        num_tokens = size * self.query_len
        meta = PagedAttentionMetadata(
            slot_mapping=inputs[_SLOTS, :num_tokens],
            block_tables=self.block_tables[:size],
            cu_seqlens_q=self.cu_seqlens[:size + 1],
            seq_lens=inputs[_LENS, :size].to(torch.int32),
            is_decode_only=self.query_len == 1,
            kv_caches=runner.kv_cache.device_caches,
            backend=runner.kernel_backend,
            plan_window=runner.attention.max_sliding_window,
        )
        with attention_context(meta):
            positions = self.positions[:num_tokens]
            positions.copy_(inputs[_POSITIONS, :num_tokens])
            hidden = self.decode_stack(inputs[_IDS, :num_tokens], positions)
        return runner.compute_logits(hidden)

    def _decode_eager(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The decoder stack's last hidden states ``[size, hidden]`` (what ``torch_compile`` compiles)."""
        return self.runner.run_decoder(input_ids, positions, FROM_CONTEXT)

    # ---- capture -----------------------------------------------------------------------------
    def _pad_only(self) -> None:
        """Every row padding: a forward then writes no KV (and with one query a sequence,
        reads none; with more, block 0's first keys)."""
        self.inputs.zero_()
        self.inputs[_SLOTS] = -1
        self.inputs[_LENS, :self.max_size] = 0 if self.query_len == 1 else self.query_len
        self.block_tables.zero_()

    def _compiled_one_token(self) -> None:
        """A compiled forward specialises one token apart from the dynamic size: compile
        it at load even where no decode size is 1 (an eager step may have one token)."""
        if self.is_compiled and 1 not in self.sizes:
            self._forward(1)

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """Run every size once on padding: the compiler compiles what each size needs."""
        start = time.perf_counter()
        self._pad_only()
        for size in reversed(self.sizes):
            self._forward(size)
        self._compiled_one_token()
        logger.info("compiled the decode forward for batch sizes %d..%d in %.1f s",
                    self.sizes[0], self.max_size, time.perf_counter() - start)

    @torch.inference_mode()
    def _capture(self) -> None:
        """Capture every size, largest first, into one memory pool. The buffers hold only
        padding meanwhile: nothing is written to the KV cache."""
        start = time.perf_counter()
        self._pad_only()
        memory_before = torch.cuda.memory_reserved(self.device)
        lora = self.lora
        # The adapters' kernels are captured on the static segments, covering nothing meanwhile.
        with (lora.using(lora.static.fill(None)) if lora is not None and lora.static is not None
              else contextlib.nullcontext()):
            self.pool = self._capture_sizes(self.pool)
        torch.cuda.synchronize(self.device)
        self.memory_bytes = torch.cuda.memory_reserved(self.device) - memory_before
        logger.info("captured %d CUDA graphs (%s batch sizes %d..%d) in %.1f s, %.0f MiB",
                    len(self.graphs), self.kind, self.sizes[0], self.max_size, time.perf_counter() - start,
                    self.memory_bytes / 2**20)

    def _capture_sizes(self, pool):
        """Each size's graph, largest first, into ``pool`` (None: a new one); returns the pool."""
        self._compiled_one_token()
        for size in reversed(self.sizes):
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):   # compiles the size's kernels; cuBLAS picks its algorithms
                    self._forward(size)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = (graph, logits)
        return pool

    @property
    def kind(self) -> str:
        return "decode" if self.query_len == 1 else f"verification ({self.query_len} tokens a sequence)"
