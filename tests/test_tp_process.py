"""Tensor-parallel workers as processes: fresh interpreters that end with their rank 0.

``LLM`` on a TP=2 artifact must work from a plain script, with no
``if __name__ == "__main__":`` guard (as in every quick start and notebook): the workers are
``python -m pagecast.runtime.tp_worker``, never multiprocessing's spawn, which runs the
script's top level again. Their rendezvous is a file in a directory only the user can enter.
And a worker whose rank 0 died must end within seconds wherever it waits, even in the
rendezvous or a collective, where torch.distributed would wait ``COLLECTIVE_TIMEOUT_S``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import build_artifact
from server_support import wait_for
from test_core_lifecycle import gone

ENGINE = 'max_num_batched_tokens=32, max_num_seqs=4, kv_cache_memory="4MiB"'


@pytest.fixture(scope="module")
def tp2(tiny_checkpoint_factory, tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    return build_artifact(tiny_checkpoint_factory("llama"), tmp_path_factory.mktemp("tp2") / "engine", tp=2)


# No main guard, on purpose. The hook records the rendezvous rank 0 joins.
PLAIN_SCRIPT = f"""
import os, stat, sys
from pagecast.runtime import LLM, SamplingParams, parallel

real_init = parallel.init_group
def init_group(backend, init_method, rank, world_size, device):
    where = os.path.dirname(init_method[len("file://"):]) if init_method.startswith("file://") else None
    mode = oct(stat.S_IMODE(os.stat(where).st_mode)) if where else None
    print("rendezvous", init_method.split(":")[0], mode, flush=True)
    return real_init(backend, init_method, rank, world_size, device)
parallel.init_group = init_group

print("top level ran", flush=True)
llm = LLM(sys.argv[1], {ENGINE})
out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
print("tokens", len(out[0].outputs[0].token_ids), flush=True)
"""


def test_llm_on_a_tp2_artifact_works_from_a_script_without_a_main_guard(tp2, tmp_path):  # type: ignore[no-untyped-def]
    script = tmp_path / "quickstart.py"
    script.write_text(PLAIN_SCRIPT)
    run = subprocess.run([sys.executable, str(script), str(tp2)], check=False, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert lines.count("top level ran") == 1  # the workers did not run the script again
    assert "tokens 4" in lines
    assert "rendezvous file 0o700" in lines  # not a TCP port every local user can reach


# Rank 0 dies after its worker loaded and went to the rendezvous, before rank 0 joins it: the
# worker waits there for a partner that will never come (torch's store timeout: 600 s).
DIES_BEFORE_RENDEZVOUS = f"""
import os, signal, sys
from pathlib import Path
from pagecast.runtime import LLM, parallel

def init_group(backend, init_method, rank, world_size, device):
    print("rendezvous", init_method, flush=True)
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat, cmdline = (entry / "stat").read_text(), (entry / "cmdline").read_bytes()
            except OSError:
                continue
            worker = b"pagecast.runtime.tp_worker" in cmdline or b"spawn_main" in cmdline
            if int(stat.rsplit(")", 1)[1].split()[1]) == me and worker:
                print("worker", entry.name, flush=True)
    os.kill(me, signal.SIGKILL)
parallel.init_group = init_group

if __name__ == "__main__":  # so that the test also runs where workers are spawned
    LLM(sys.argv[1], {ENGINE})
"""


def test_a_worker_ends_within_seconds_when_rank_0_dies(tp2, tmp_path):  # type: ignore[no-untyped-def]
    script = tmp_path / "dies.py"
    script.write_text(DIES_BEFORE_RENDEZVOUS)
    rank0 = subprocess.run([sys.executable, str(script), str(tp2)], check=False, capture_output=True, text=True, timeout=300)
    workers = [int(line.split()[1]) for line in rank0.stdout.splitlines() if line.startswith("worker ")]
    assert rank0.returncode == -9 and len(workers) == 1, rank0.stdout + rank0.stderr[-3000:]
    start = time.monotonic()
    try:
        while not gone(workers[0]) and time.monotonic() - start < 10:
            time.sleep(0.1)
        assert gone(workers[0]), "the worker outlived its rank 0 by 10 s"
        (rendezvous,) = [line.split()[1] for line in rank0.stdout.splitlines() if line.startswith("rendezvous ")]
        assert rendezvous.startswith("file://")
        # Rank 0 is dead, so the worker removes the private rendezvous directory.
        wait_for(lambda: not Path(rendezvous[len("file://"):]).parent.exists(), timeout=5)
    finally:
        if not gone(workers[0]):
            os.kill(workers[0], 9)
