"""The progress bar of ``LLM.generate``: prompts finished and token rates, on stderr."""

from __future__ import annotations

import time
from typing import Any

from pagecast.runtime.outputs import RequestOutput


class GenerateProgress:
    """A tqdm bar over the prompts of one ``generate`` call, with input and output tokens per
    second as its postfix. Disabled, it does nothing (no tqdm object, nothing printed)."""

    def __init__(self, total: int, enabled: bool = True):
        self.bar: Any = None
        if not enabled:
            return
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, desc="Processed prompts", unit="prompt", dynamic_ncols=True)
        self.start = time.perf_counter()
        self.num_prompt_tokens = 0
        self.num_output_tokens = 0

    def update(self, out: RequestOutput) -> None:
        if self.bar is None:
            return
        self.num_prompt_tokens += len(out.prompt_token_ids)
        self.num_output_tokens += sum(len(o.token_ids) for o in out.outputs)
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(
            f"input: {self.num_prompt_tokens / elapsed:,.1f} tok/s, output: {self.num_output_tokens / elapsed:,.1f} tok/s",
            refresh=False,
        )
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
