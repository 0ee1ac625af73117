"""What a prompt token costs on the CPU, to choose the CPU's bound on a step's prompt tokens
(engine_core.CPU_MAX_NUM_PREFILL_TOKENS): CPU seconds (this process's time, so other processes'
load does not count) of one prefill chunk of c tokens after a cached context of L tokens and at
the start, one torch thread, min of 3; then decode steps of one sequence at that context.

    python benchmarks/cpu_step_budget.py [ARTIFACT] [L]     # default: artifacts/smollm2-135m, 2048

A chunk costs c * (a + b * L): from the two contexts, a (per token) and b (per token of context),
hence the cost of a chunk at the end of a long prompt. Informative, not a gate.
"""
import random
import sys
import time

import torch

from pagecast.runtime import LLM, SamplingParams

torch.set_num_threads(1)
ARTIFACT = sys.argv[1] if len(sys.argv) > 1 else "artifacts/smollm2-135m"
llm = LLM(ARTIFACT, max_num_batched_tokens=2048, max_num_seqs=8, max_num_prefill_tokens=2048)
eng = llm.engine
rng = random.Random(0)
def cpu_of_steps(prompt, max_tokens=1):
    eng.add_request(None, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    ts = []
    while eng.has_unfinished_requests():
        t = time.process_time(); w = time.perf_counter(); eng.step(); ts.append((time.process_time() - t, time.perf_counter() - w))
    return ts
L = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
prefix = [rng.randrange(100, 40000) for _ in range(L)]
print("prefix", L, [(round(a, 1), round(b, 1)) for a, b in cpu_of_steps(prefix)], flush=True)
for c in (128, 256, 512):
    for ctx in (L, 0):
        head = prefix if ctx else []
        best = min(cpu_of_steps(head + [rng.randrange(100, 40000) for _ in range(c)])[0] for _ in range(3))
        print(f"c={c} L={ctx}: cpu {best[0]:.2f} s wall {best[1]:.2f} s", flush=True)
print("decode 1 seq at L+1 (cpu, wall)", [(round(a, 3), round(b, 3)) for a, b in cpu_of_steps(prefix + [5], max_tokens=4)[1:]], flush=True)
