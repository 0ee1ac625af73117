"""The running requests' block tables, kept on the device from step to step (issue 33).

Building every step's padded block tables from Python lists costs the host time proportional to
batch x context (about 10 ms a step at 256 sequences of 8k tokens). Instead each running request
owns a row of a persistent int32 table on the runner's device; a step writes only the entries
that changed since the last one (a decode adds a block every block_size tokens), in one small
host-to-device copy, and the step's table is a gather of its requests' rows on the device.

A request's ``block_ids`` list only grows in place while it runs; any other change replaces the
list (the block pool's ``free`` on a finish or a preemption, then a new list on resumption), so a
row whose list is not the one it was written from, is shorter, or no longer holds the last id
written at its place, is written again. Rows are given
back when the scheduler reports a request finished or preempted; a row whose request stopped
running without being reported (e.g. a step with nothing to run) is reclaimed when rows run out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from pagecast.runtime.request import Request, RequestStatus
from pagecast.runtime.transfer import to_device


@dataclass
class _Row:
    index: int
    request: Request
    blocks: list[int]  # the list the row was written from (request.block_ids, unless replaced)
    num_written: int  # its entries in the row
    last: int = 0  # the last of them (a cheap check that the list was only appended to)


class BlockTables:
    """Persistent block tables: one row per running request, ``[rows, cols]`` int32 on ``device``.

    Per step: ``rows(requests)`` brings the requests' rows up to date (queueing the changed
    entries) and returns their indices; ``gather(rows, width)`` sends the queued entries to the
    device in one copy and returns the step's ``[len(rows), width]`` table (zero past each
    request's blocks), a tensor of its own: later writes to the rows do not change it. Both the
    writes and the gather are queued on the device's current stream, so a step in flight keeps
    the table it gathered.

    ``num_rows`` and ``num_cols`` are the initial capacity (e.g. max_num_seqs and
    ceil(max_model_len / block_size)); the table grows (doubling) past them, up to ``max_rows``
    and ``max_cols`` when given, past which ``rows`` raises.
    """

    def __init__(
        self,
        device: torch.device,
        num_rows: int = 64,
        num_cols: int = 64,
        max_rows: int | None = None,
        max_cols: int | None = None,
    ):
        self.device = device
        self.max_rows = max_rows
        self.max_cols = max_cols
        self.table = torch.zeros((max(num_rows, 1), max(num_cols, 1)), dtype=torch.int32, device=device)
        self._rows: dict[str, _Row] = {}  # request id -> its row
        self._free: list[int] = list(range(self.table.shape[0] - 1, -1, -1))  # popped from the end: lowest first
        # Per row index: how many leading entries may be non-zero (a free row keeps its old ids
        # until it is written again, then the tail past the new blocks is zeroed).
        self._filled = [0] * self.table.shape[0]
        self._writes: list[tuple[int, int, list[int]]] = []  # (row, first column, values), not yet sent

    @property
    def num_used_rows(self) -> int:
        return len(self._rows)

    def release(self, request_ids: Iterable[str]) -> None:
        """Give back the rows of requests that finished, were aborted or preempted (unknown ids
        are ignored)."""
        for request_id in request_ids:
            row = self._rows.pop(request_id, None)
            if row is not None:
                self._free.append(row.index)

    def rows(self, requests: list[Request]) -> list[int]:
        """The row of each request, its entries brought up to date with its ``block_ids``."""
        out = []
        for request in requests:
            row = self._rows.get(request.request_id)
            if row is None or row.request is not request:  # new, or a reused id
                if row is None:
                    if not self._free:
                        self._make_room({r.request_id for r in requests})
                    row = _Row(self._free.pop(), request, request.block_ids, 0)
                    self._rows[request.request_id] = row
                else:
                    row.request, row.blocks, row.num_written = request, request.block_ids, 0
                self._write(row, request.block_ids, 0)
            else:
                blocks, n = request.block_ids, row.num_written
                if blocks is row.blocks and len(blocks) >= n and (not n or blocks[n - 1] == row.last):
                    if len(blocks) > n:
                        self._write(row, blocks, n)
                else:  # replaced (preempted and resumed) or changed in place: write it all again
                    row.blocks = blocks
                    self._write(row, blocks, 0)
            out.append(row.index)
        return out

    def gather(self, rows: list[int], width: int) -> torch.Tensor:
        """The step's block tables: row ``rows[i]``'s first ``width`` entries, for each i."""
        width = max(width, 1)
        if width > self.table.shape[1]:
            self._grow(self.table.shape[0], width)
        writes, self._writes = self._writes, []
        cols = self.table.shape[1]
        flat: list[int] = list(rows)
        values: list[int] = []
        for r, first, vals in writes:
            base = r * cols + first
            flat.extend(range(base, base + len(vals)))
            values.extend(vals)
        # One copy for the row indices, the entries' flat indices and their values.
        packed = to_device(flat + values, self.device, torch.int64)
        if values:
            n = len(values)
            self.table.view(-1)[packed[len(rows) : len(rows) + n]] = packed[len(rows) + n :].to(torch.int32)
        return torch.index_select(self.table[:, :width], 0, packed[: len(rows)])

    def _write(self, row: _Row, blocks: list[int], first: int) -> None:
        """Queue ``blocks[first:]`` into the row (and zeros over what it held past them)."""
        n = len(blocks)
        if n > self.table.shape[1]:
            if self.max_cols is not None and n > self.max_cols:
                raise ValueError(
                    f"request {row.request.request_id!r} holds {n} blocks, more than the block "
                    f"tables' max_cols ({self.max_cols}: max_model_len / block_size)"
                )
            self._grow(self.table.shape[0], n)
        vals = blocks[first:]
        filled = self._filled[row.index]
        if filled > n:
            vals = vals + [0] * (filled - n)
        if vals:
            self._writes.append((row.index, first, vals))
        self._filled[row.index] = n
        row.num_written = n
        row.last = blocks[-1] if blocks else 0

    def _make_room(self, keep: set[str]) -> None:
        """Free rows: first those of requests no longer running (not in ``keep``, this step's),
        else grow the table."""
        for request_id, row in list(self._rows.items()):
            if request_id not in keep and row.request.status is not RequestStatus.RUNNING:
                del self._rows[request_id]
                self._free.append(row.index)
        if self._free:
            return
        num_rows = self.table.shape[0]
        if self.max_rows is not None and num_rows >= self.max_rows:
            raise RuntimeError(
                f"block tables are full: {num_rows} running requests hold rows (max_rows {self.max_rows}); "
                f"more requests run at once than the runner was sized for (max_num_seqs)"
            )
        new_rows = 2 * num_rows if self.max_rows is None else min(2 * num_rows, self.max_rows)
        self._grow(new_rows, self.table.shape[1])

    def _grow(self, num_rows: int, num_cols: int) -> None:
        old_rows, old_cols = self.table.shape
        if num_cols > old_cols:
            num_cols = max(num_cols, 2 * old_cols)
            if self.max_cols is not None:
                num_cols = min(num_cols, self.max_cols)
        num_cols = max(num_cols, old_cols)
        # Queued writes hold (row, column) pairs: flat indices are computed when they are sent.
        table = torch.zeros((num_rows, num_cols), dtype=torch.int32, device=self.device)
        table[:old_rows, :old_cols] = self.table
        self.table = table
        self._free.extend(range(num_rows - 1, old_rows - 1, -1))
        self._filled.extend([0] * (num_rows - old_rows))

