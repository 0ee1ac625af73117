"""The tensor-parallel worker group: rank 0 plus one worker process per other rank.

Rank 0 is whichever process runs the ModelRunner (the engine core): the scheduler and the
sampler run there only. Ranks 1..tp-1 are worker processes (``python -m pagecast.runtime.tp_worker``, fresh
interpreters, so ``LLM`` works from any script or notebook) that each load
their own weight shard and mirror rank 0's forward pass, so every collective in the model
(``ops.all_reduce`` after row-parallel layers, the vocab-parallel embedding and the LM-head
gather) meets its partners. torch.distributed runs NCCL on GPUs and gloo on the CPU.

Messages, rank 0 -> every worker:

- a control message over the worker's pipe (a small tuple, see ``Op``): what comes next and
  its sizes. Workers block on the pipe while the engine is idle, so an idle server never
  waits inside a collective (where NCCL and gloo time out);
- for a step, one broadcast of the flat batch (token ids, positions, slot mapping, block
  tables, sequence lengths, query starts, logits rows as one int64 tensor) on the group.

Nothing comes back: rank 0 samples from the gathered logits. A worker that dies is noticed
by the pipe (a broken pipe on the next message), by its end of the pipe closing (a watchdog
thread that aborts the process group, so a collective in flight fails instead of hanging), or
by gloo itself (a closed connection); each becomes a ``WorkerDiedError`` naming the rank.
Workers exit when rank 0 goes away, within a second even inside a collective or the
rendezvous (a thread of theirs watches rank 0). The rendezvous is a file in a 0700 directory.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from pagecast.runtime.forward_context import ForwardContext
from pagecast.runtime.ipc import private_dir

logger = logging.getLogger("pagecast.engine")

# Backstop for a collective whose partner neither answers nor dies (seconds).
COLLECTIVE_TIMEOUT_S = float(os.environ.get("PAGECAST_TP_TIMEOUT", "600"))
# Experimental, GPU only: "symm_mem" all-reduces messages up to SYMM_MEM_BYTES with torch's
# one-shot symmetric-memory kernel (NVLink peer loads, no multicast) instead of NCCL, whose
# latency dominates decode steps of one token (two all-reduces per layer).
ALL_REDUCE = os.environ.get("PAGECAST_TP_ALLREDUCE", "nccl")
SYMM_MEM_BYTES = 8 << 20


class Op:
    """Control messages over the pipe: (op, *arguments)."""

    KV_CACHE = "kv_cache"  # (op, shape, dtype name): allocate and bind this rank's KV cache
    CAPTURE = "capture"  # (op, batch sizes, max_model_len, block size): capture decode CUDA graphs
    STEP = "step"  # (op, StepHeader fields...): a broadcast of the flat batch follows
    SHUTDOWN = "shutdown"  # (op,): exit


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process is gone; the engine cannot run another step."""


@dataclass(frozen=True)
class TPLaunch:
    """What rank 0 needs to start the other ranks; set on the loaded model by the loader."""

    artifact_dir: str
    tp: int
    device_type: str  # "cpu" (gloo) or "cuda" (NCCL, rank r on cuda:r)
    verify_weights: bool = True  # workers check their weight file's hashes while reading it
    dtype: str = "float32"  # activations' dtype (the symmetric all-reduce buffer's)
    all_reduce: str = "nccl"  # "nccl" or "symm_mem" (see ALL_REDUCE)

    def __post_init__(self) -> None:
        if self.all_reduce not in ("nccl", "symm_mem"):
            raise ValueError(f"PAGECAST_TP_ALLREDUCE must be nccl or symm_mem (got {self.all_reduce!r})")


@dataclass(frozen=True)
class StepHeader:
    """Sizes of one step's flat batch, so a worker can receive and split the broadcast."""

    num_tokens: int
    num_seqs: int
    max_blocks: int  # block-table width
    max_query_len: int
    max_seq_len: int
    num_logits: int  # rows projected to logits (0: no LM head this step)
    use_graph: bool  # rank 0 replays a decode CUDA graph: so must every rank
    num_decodes: int = 0  # ForwardContext.num_decodes

    @property
    def payload_len(self) -> int:
        t, s = self.num_tokens, self.num_seqs
        return 3 * t + s * self.max_blocks + s + (s + 1) + self.num_logits


def pack_step(input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
    """One int64 tensor holding a step's batch (on rank 0's device), in StepHeader order."""
    return torch.cat(
        [
            input_ids.to(torch.int64),
            positions.to(torch.int64),
            ctx.slot_mapping.to(torch.int64),
            ctx.block_tables.to(torch.int64).flatten(),
            ctx.seq_lens.to(torch.int64),
            ctx.query_start_loc.to(torch.int64),
            ctx.logits_indices.to(torch.int64),
        ]
    )


def unpack_step(payload: torch.Tensor, h: StepHeader) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
    t, s = h.num_tokens, h.num_seqs
    ids, pos, slots, tables, seq_lens, qsl, logits = payload.split(
        [t, t, t, s * h.max_blocks, s, s + 1, h.num_logits]
    )
    ctx = ForwardContext(
        slot_mapping=slots,
        block_tables=tables.view(s, h.max_blocks).to(torch.int32),
        seq_lens=seq_lens.to(torch.int32),
        query_start_loc=qsl.to(torch.int32),
        max_query_len=h.max_query_len,
        max_seq_len=h.max_seq_len,
        logits_indices=logits,
        num_decodes=h.num_decodes,
    )
    return ids, pos, ctx


def start_worker(
    launch: TPLaunch, rank: int, init_method: str, threads: int
) -> tuple[subprocess.Popen[bytes], multiprocessing.connection.Connection]:
    """Rank ``rank`` as a fresh interpreter (``python -m pagecast.runtime.tp_worker``), never
    multiprocessing's spawn, which imports the caller's ``__main__`` again (a plain script or a
    notebook then fails, or runs its own code twice). Its pipe is one end of a socket pair that
    only the two processes hold; its arguments go through it."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagecast.runtime.tp_worker", str(theirs.fileno())], pass_fds=(theirs.fileno(),)
        )
        conn = multiprocessing.connection.Connection(ours.detach())
    conn.send((launch, rank, init_method, threads))
    return proc, conn


def _exit_code(proc: subprocess.Popen[bytes], wait_s: float = 2.0) -> int | None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(wait_s)  # its socket closed a moment before the process was reaped
    return proc.returncode


def init_group(backend: str, init_method: str, rank: int, world_size: int, device: torch.device) -> None:
    import torch.distributed as dist

    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        kwargs["device_id"] = device  # connect now, not on the first collective (inside a graph capture)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S), **kwargs,
    )


def symmetric_buffer(launch: TPLaunch, device: torch.device) -> tuple[torch.Tensor, str] | None:
    """Every rank's all-reduce staging buffer in symmetric memory (collective: all ranks call it),
    or None where NCCL does every all-reduce."""
    if launch.all_reduce != "symm_mem" or device.type != "cuda":
        return None
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    group_name = dist.group.WORLD.group_name
    symm_mem.enable_symm_mem_for_group(group_name)
    dtype = getattr(torch, launch.dtype)
    buffer = symm_mem.empty(SYMM_MEM_BYTES // dtype.itemsize, dtype=dtype, device=device)
    symm_mem.rendezvous(buffer, group_name)
    return buffer, group_name


class WorkerGroup:
    """Rank 0's handle on the other ranks: starts them, sends them each step, stops them.

    Used by one thread (the engine's); ``close`` may come from any thread or a finalizer."""

    def __init__(self, launch: TPLaunch, device: torch.device, kernels: Any = None):
        import torch.distributed as dist

        from pagecast.kernels import ops

        if dist.is_initialized():
            raise RuntimeError(
                "a tensor-parallel engine is already running in this process (torch.distributed is "
                "initialised): run one tensor-parallel engine per process, or close the other one first"
            )
        self.launch = launch
        self.device = device
        self.backend = "nccl" if launch.device_type == "cuda" else "gloo"
        self.failed: str | None = None
        self.kv_cache_sent = False
        self._closed = False
        # The rendezvous is a file in a directory only this user can enter, not a TCP port that
        # every local user could reach.
        self._rendezvous_dir = private_dir("pagecast-tp-")
        init_method = f"file://{os.path.join(self._rendezvous_dir, 'rendezvous')}"
        threads = max(1, torch.get_num_threads() // launch.tp)
        self.conns: list[multiprocessing.connection.Connection] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        for rank in range(1, launch.tp):
            proc, conn = start_worker(launch, rank, init_method, threads)
            self.conns.append(conn)
            self.procs.append(proc)
        try:
            self._wait_ready()
            init_group(self.backend, init_method, 0, launch.tp, device)
        except BaseException:
            self.close()
            raise
        self.kernels = kernels if kernels is not None else ops.active()  # the engine's table carries its rank
        ops.set_tensor_parallel(self.kernels, 0, launch.tp, symmetric_buffer(launch, device))
        self._stop_r, self._stop_w = os.pipe()
        self._watchdog = threading.Thread(target=self._watch, name="pagecast-tp-watchdog", daemon=True)
        self._watchdog.start()

    # -- start-up and health -------------------------------------------------------------------

    def _wait_ready(self) -> None:
        """Every worker loaded its shard (or failed to: its error is raised here)."""
        pending = {c: r for r, c in enumerate(self.conns, start=1)}
        while pending:
            for ready in multiprocessing.connection.wait(list(pending)):
                rank = pending.pop(ready)  # type: ignore[call-overload]
                try:
                    kind, detail = ready.recv()  # type: ignore[union-attr]
                except (EOFError, OSError):
                    code = _exit_code(self.procs[rank - 1])
                    raise WorkerDiedError(f"tensor-parallel worker rank {rank} exited while loading (exit code {code})")
                if kind != "ready":
                    raise WorkerDiedError(f"tensor-parallel worker rank {rank} failed to load: {detail}")

    def _watch(self) -> None:
        """Notice a worker's death while rank 0 may be inside a collective and abort the group,
        so the collective fails (an error) instead of waiting for a partner that is gone."""
        # A worker sends nothing after "ready": its socket turns readable only when it ends.
        ready = multiprocessing.connection.wait([*self.conns, self._stop_r])
        if self._stop_r in ready or self._closed:
            return
        self.failed = self._dead_message()
        logger.error("%s; aborting the tensor-parallel group", self.failed)
        if self.backend == "nccl":
            with contextlib.suppress(Exception):
                import torch.distributed as dist

                dist.distributed_c10d._abort_process_group()  # unblocks NCCL kernels waiting on the dead rank

    def _dead_message(self, wait_s: float = 2.0) -> str:
        deadline = time.monotonic() + wait_s  # a process whose sentinel fired may not be reaped yet
        while not any(p.poll() is not None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.01)
        dead = [(r, p.returncode) for r, p in enumerate(self.procs, start=1) if p.poll() is not None]
        if not dead:
            return "a tensor-parallel worker stopped answering"
        return "; ".join(f"tensor-parallel worker rank {r} died (exit code {c})" for r, c in dead)

    def check(self) -> None:
        """Raise WorkerDiedError if any worker is gone (a waitpid per worker: cheap)."""
        if self._closed:
            raise WorkerDiedError("the tensor-parallel worker group is closed")
        if self.failed is None and any(p.poll() is not None for p in self.procs):
            self.failed = self._dead_message()
        if self.failed is not None:
            raise WorkerDiedError(self.failed + ": the engine cannot run; restart it")

    def _send(self, message: tuple[Any, ...]) -> None:
        self.check()
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send(message)
            except OSError as e:  # broken pipe: the worker is gone
                self.failed = self.failed or f"tensor-parallel worker rank {rank} is gone ({e})"
                self.check()

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Turn a collective's failure into WorkerDiedError when a worker is the cause."""
        try:
            yield
        except WorkerDiedError:
            raise
        except Exception as e:
            message = self.failed or self._dead_message()
            if self.failed is None and not any(p.poll() is not None for p in self.procs):
                raise
            self.failed = message
            raise WorkerDiedError(f"{self.failed}: the engine cannot run; restart it") from e

    # -- messages ------------------------------------------------------------------------------

    def send_kv_cache(self, k_caches: list[torch.Tensor]) -> None:
        """Every worker allocates a KV cache of rank 0's shape (the builder made the shards equal)."""
        shape = (len(k_caches), 2, *k_caches[0].shape)
        self._send((Op.KV_CACHE, shape, str(k_caches[0].dtype).removeprefix("torch.")))
        self.kv_cache_sent = True

    def capture(self, batch_sizes: list[int], max_model_len: int, block_size: int) -> None:
        """Workers capture the same decode graphs as rank 0, at the same time (the warm-up
        passes' all-reduces pair up across ranks)."""
        self._send((Op.CAPTURE, list(batch_sizes), max_model_len, block_size))

    def send_step(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, use_graph: bool) -> None:
        import torch.distributed as dist

        header = StepHeader(
            num_tokens=int(input_ids.shape[0]),
            num_seqs=int(ctx.seq_lens.shape[0]),
            max_blocks=int(ctx.block_tables.shape[1]),
            max_query_len=ctx.max_query_len,
            max_seq_len=ctx.max_seq_len,
            num_logits=int(ctx.logits_indices.shape[0]),
            use_graph=use_graph,
            num_decodes=ctx.num_decodes,
        )
        self._send((Op.STEP, header))
        with self.guard():
            dist.broadcast(pack_step(input_ids, positions, ctx), src=0)

    def close(self) -> None:
        """Stop the workers and leave the process group (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if hasattr(self, "_stop_w"):
            with contextlib.suppress(OSError):
                os.write(self._stop_w, b"x")
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send((Op.SHUTDOWN,))
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        for conn in self.conns:
            conn.close()
        if hasattr(self, "_rendezvous_dir"):
            shutil.rmtree(self._rendezvous_dir, ignore_errors=True)
        import torch.distributed as dist

        from pagecast.kernels import ops

        if hasattr(self, "kernels"):
            ops.set_tensor_parallel(self.kernels, 0, 1)
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
