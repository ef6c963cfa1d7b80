"""Persistent block-table rows: each running sequence's table lives in one row of a
reused int32 tensor, and a step writes only the entries that changed.

The KV manager says, per scheduled sequence, the first table entry that may
differ from what that sequence's table held the last time it was scheduled
(``ScheduledSeq.first_changed_block``). ``BlockTableRows.prepare`` writes
entries from there on (all of them into a row just given to a sequence), in
one batched write to the host tensor and, on CUDA, the same few entries to a
device copy; the step's ``[num_seqs, max_blocks]`` table is then one gather of
the step's rows on the device. Python work per step is O(sequences + changed
entries), never O(total blocks).

Entries past a sequence's table (a reused row's older, longer contents, or
zeros) are never read: kernels read only the blocks that cover each
sequence's length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .host_lists import to_device


@dataclass
class StepTables:
    """One step's view of the rows, in the step's sequence order.

    ``block_tables``: ``[num_seqs, max_blocks]`` int32 on the model's device;
    ``rows``: each sequence's row in ``host`` (int64, on the CPU), for
    host-side lookups such as the slot mapping.
    """

    block_tables: torch.Tensor
    rows: torch.Tensor
    host: torch.Tensor


class BlockTableRows:
    """Block tables of running sequences as rows of one persistent tensor.

    A sequence gets a row the first time ``prepare`` sees it and keeps it
    until ``release``; the caller releases every sequence that finishes, is
    preempted or migrates (``check`` finds rows held by anyone else). Rows and
    columns grow by doubling and are never shrunk.
    """

    def __init__(self, device: torch.device, num_rows: int = 64, num_columns: int = 64) -> None:
        self.device = torch.device(device)
        self.host = torch.zeros((num_rows, num_columns), dtype=torch.int32)
        self.mirror = self._to_device(self.host)
        self._row_of: dict[str, int] = {}
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self.num_entries_written = 0  # total, for tests and benchmarks

    @property
    def num_rows_in_use(self) -> int:
        return len(self._row_of)

    def holders(self) -> set[str]:
        return set(self._row_of)

    @property
    def num_rows(self) -> int:
        return self.host.shape[0]

    @property
    def source(self) -> torch.Tensor:
        """The rows on the model's device (the device copy, or the host tensor on the CPU)."""
        return self.host if self.mirror is None else self.mirror

    def reserve_columns(self, num_columns: int) -> None:
        """Make room for tables of ``num_columns`` entries now (a static user's width)."""
        self._ensure_columns(num_columns)

    def row_of(self, seq_id: str) -> int | None:
        return self._row_of.get(seq_id)

    def take_row(self, seq_id: str) -> int:
        """Give ``seq_id`` a row (growing the tensor if every row is held); its entries
        are stale until ``write`` fills them from entry 0."""
        if seq_id in self._row_of:
            raise ValueError(f"{seq_id!r} already holds row {self._row_of[seq_id]}")
        if not self._free_rows:
            num_rows, num_columns = self.host.shape
            self._resize(2 * num_rows, num_columns)
            self._free_rows = list(range(2 * num_rows - 1, num_rows - 1, -1))
        row = self._free_rows.pop()
        self._row_of[seq_id] = row
        return row

    def ensure_rows(self, num_rows: int) -> None:
        """Hold at least ``num_rows`` rows, by doubling. For a tensor-parallel rank's copy of
        the tables, whose rows rank 0 hands out: its ``write`` may name any row rank 0 has."""
        old_rows, num_columns = self.host.shape
        new_rows = old_rows
        while new_rows < num_rows:
            new_rows *= 2
        if new_rows != old_rows:
            self._resize(new_rows, num_columns)
            self._free_rows[:0] = range(new_rows - 1, old_rows - 1, -1)

    def write(self, updates: Sequence[tuple[int, Sequence[int], int]]) -> None:
        """Bring rows up to date: each (row, whole table, first changed entry) writes the
        table's entries from there on (one batched write, and its copy on the device)."""
        change_rows: list[int] = []
        change_columns: list[int] = []
        change_values: list[int] = []
        max_blocks = 1
        for row, table, first in updates:
            num_blocks = len(table)
            if num_blocks > max_blocks:
                max_blocks = num_blocks
            change_rows.extend([row] * (num_blocks - first))
            change_columns.extend(range(first, num_blocks))
            change_values.extend(table[first:])
        self._ensure_columns(max_blocks)
        if change_values:
            self._write(change_rows, change_columns, change_values)

    def gather(self, rows: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """The first ``num_blocks`` entries of ``rows`` (int64, on the CPU), as a
        ``[len(rows), num_blocks]`` int32 tensor on the model's device."""
        self._ensure_columns(num_blocks)
        if self.mirror is None:
            return self.host[:, :num_blocks].index_select(0, rows)
        return self.mirror[:, :num_blocks].index_select(0, to_device(rows, self.device))

    def prepare(self, seq_ids: Sequence[str], tables: Sequence[Sequence[int]],
                first_changed: Sequence[int]) -> StepTables:
        """Bring the rows of these sequences up to date and gather them (a row is
        taken for a sequence seen for the first time).

        ``tables[i]`` is sequence ``seq_ids[i]``'s whole block table (read, not
        kept); entries before ``first_changed[i]`` are taken as unchanged since
        the sequence was last prepared, unless its row is new.
        """
        rows: list[int] = []
        updates = []
        max_blocks = 1
        for seq_id, table, first in zip(seq_ids, tables, first_changed, strict=True):
            row = self._row_of.get(seq_id)
            if row is None:
                row = self.take_row(seq_id)
                first = 0
            rows.append(row)
            max_blocks = max(max_blocks, len(table))
            if first < len(table):
                updates.append((row, table, first))
        self.write(updates)
        row_index = torch.tensor(rows, dtype=torch.int64)
        return StepTables(self.gather(row_index, max_blocks), row_index, self.host)

    def release(self, seq_id: str) -> None:
        """Give the sequence's row back (nothing if it holds none)."""
        row = self._row_of.pop(seq_id, None)
        if row is not None:
            self._free_rows.append(row)

    def check(self, live_seq_ids: set[str]) -> None:
        """Raise if a row is held by a sequence not in ``live_seq_ids`` (a leak), or the
        free list and the held rows do not partition the rows."""
        leaked = set(self._row_of) - live_seq_ids
        if leaked:
            raise RuntimeError(f"block-table rows leaked by sequences no longer running: {sorted(leaked)[:5]}")
        held = set(self._row_of.values())
        if len(held) != len(self._row_of) or held & set(self._free_rows) \
                or len(held) + len(self._free_rows) != self.host.shape[0]:
            raise RuntimeError("block-table rows: free list and held rows do not partition the rows")

    # ---- internals ------------------------------------------------------------------
    def _to_device(self, host: torch.Tensor) -> torch.Tensor | None:
        return None if self.device.type == "cpu" else to_device(host, self.device)

    def _ensure_columns(self, num_blocks: int) -> None:
        num_rows, num_columns = self.host.shape
        if num_blocks > num_columns:
            while num_columns < num_blocks:
                num_columns *= 2
            self._resize(num_rows, num_columns)

    def _resize(self, num_rows: int, num_columns: int) -> None:
        old = self.host
        self.host = torch.zeros((num_rows, num_columns), dtype=torch.int32)
        self.host[:old.shape[0], :old.shape[1]] = old
        self.mirror = self._to_device(self.host)

    def _write(self, rows: list[int], columns: list[int], values: list[int]) -> None:
        changes = torch.tensor([rows, columns, values], dtype=torch.int64)
        self.host[changes[0], changes[1]] = changes[2].to(torch.int32)
        if self.mirror is not None:
            on_device = to_device(changes, self.device)
            self.mirror[on_device[0], on_device[1]] = on_device[2].to(torch.int32)
        self.num_entries_written += len(values)
