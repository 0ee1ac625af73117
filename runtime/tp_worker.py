"""A tensor-parallel worker: rank r >= 1 of an engine, in a process of its own.

It loads rank r's weight shard, joins rank 0's process group and then mirrors rank 0's
forward pass step by step (see ``parallel`` for the messages): the same eager pass or the
same decode CUDA graph, the same LM-head gather. It samples nothing and returns nothing.
It exits on a shutdown message, when rank 0's end of the pipe closes, within
``ipc.PARENT_POLL_S`` of rank 0's death wherever it is (a collective or the rendezvous included,
which would otherwise wait for ``COLLECTIVE_TIMEOUT_S``), or on any error (rank 0 then sees a
dead worker). It ignores SIGINT and SIGTERM: a signal to the process group is the server's to
handle, and rank 0 stops its workers when it stops.

Run as ``python -m pagecast.runtime.tp_worker FD``: FD is its end of a socket pair with rank
0, over which its arguments and then the control messages arrive.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import signal
import sys
import traceback
from typing import Any

import torch

from pagecast.runtime import ipc
from pagecast.runtime.parallel import Op, StepHeader, TPLaunch, init_group, symmetric_buffer, unpack_step


class Worker:
    """Rank r's model, KV cache and decode graphs."""

    def __init__(self, launch: TPLaunch, rank: int):
        from pagecast.runtime.loader import load_rank

        self.rank = rank
        if launch.device_type == "cuda":
            torch.cuda.set_device(rank)
            self.device = torch.device("cuda", rank)
        else:
            self.device = torch.device("cpu")
        self.model = load_rank(launch.artifact_dir, rank, self.device, launch.verify_weights)
        self.graphs: Any = None
        self.kv_cache: torch.Tensor | None = None

    def kv_cache_op(self, shape: tuple[int, ...], dtype: str) -> None:
        from pagecast.runtime.loader import zeros_kv_cache

        self.kv_cache = zeros_kv_cache(shape, getattr(torch, dtype), self.device)
        self.model.bind_kv_cache(self.kv_cache)

    def capture_op(self, batch_sizes: list[int], max_model_len: int, block_size: int) -> None:
        from pagecast.runtime.cuda_graphs import DecodeGraphs

        self.graphs = DecodeGraphs(self.model, self.device, batch_sizes, max_model_len, block_size)
        self.graphs.capture()

    @torch.inference_mode()
    def step_op(self, header: StepHeader) -> None:
        import torch.distributed as dist

        payload = torch.empty(header.payload_len, dtype=torch.int64, device=self.device)
        dist.broadcast(payload, src=0)
        input_ids, positions, ctx = unpack_step(payload, header)
        if header.use_graph:
            hidden = self.graphs.run(
                input_ids, positions, ctx.slot_mapping, ctx.block_tables, ctx.seq_lens, ctx.max_seq_len
            )
            self.model.compute_logits(hidden)  # the gather pairs with rank 0's
            return
        hidden = self.model.forward(input_ids, positions, ctx)
        if header.num_logits:
            self.model.compute_logits(hidden[ctx.logits_indices])


_rendezvous_dir: list[str] = []  # set once the arguments arrived: removed if rank 0 cannot


def main() -> None:
    """``python -m pagecast.runtime.tp_worker FD``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ipc.exit_with_parent(os.getppid(), _rendezvous_dir, "pagecast-tp-parent")
    conn = multiprocessing.connection.Connection(int(sys.argv[1]))
    try:
        launch, rank, init_method, threads = conn.recv()
    except (EOFError, OSError):
        os._exit(1)  # rank 0 went away before it said what to run
    if init_method.startswith("file://"):
        _rendezvous_dir.append(os.path.dirname(init_method[len("file://"):]))
    run(launch, rank, conn, init_method, threads)


def run(
    launch: TPLaunch, rank: int, conn: multiprocessing.connection.Connection, init_method: str, threads: int
) -> None:
    """Load rank ``rank``, join the group and mirror rank 0's steps until told to stop."""
    torch.set_num_threads(threads)
    try:
        worker = Worker(launch, rank)
    except BaseException as e:  # noqa: BLE001 - report any failure to rank 0, which raises it
        conn.send(("error", f"{type(e).__name__}: {e}"))
        os._exit(1)
    conn.send(("ready", None))
    from pagecast.kernels import ops

    try:
        init_group("nccl" if launch.device_type == "cuda" else "gloo", init_method, rank, launch.tp, worker.device)
        # The only table in this process.
        ops.set_tensor_parallel(ops.active(), rank, launch.tp, symmetric_buffer(launch, worker.device))
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break  # rank 0 is gone
            op = message[0]
            if op == Op.STEP:
                worker.step_op(message[1])
            elif op == Op.KV_CACHE:
                worker.kv_cache_op(*message[1:])
            elif op == Op.CAPTURE:
                worker.capture_op(*message[1:])
            elif op == Op.SHUTDOWN:
                break
    except BaseException:  # noqa: BLE001 - any failure ends the worker; rank 0 sees it die
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)  # no atexit or process-group teardown that could wait on rank 0
    os._exit(0)


if __name__ == "__main__":
    main()
