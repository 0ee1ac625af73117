"""The newcomer path: the README's first example, run as written against the embedded model,
finishes in seconds on a CPU (it once generated 2,129 tokens and timed out the SDK)."""

from __future__ import annotations

import contextlib
import io
import re
import time
from pathlib import Path

import pytest
from server_support import make_engine, serve

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[1] / "README.md"


def first_python_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert blocks, "the README has no python example"
    return blocks[0]


def test_first_example_bounds_its_reply() -> None:
    code = first_python_example()
    assert "max_tokens=" in code, "without max_tokens a chat reply may run to the context length"
    assert "temperature=0," in code, "a sampled reply does not always print the promised answer"
    assert 'base_url="http://localhost:8000/v1"' in code


def test_first_example_answers_in_seconds_on_a_cpu(smollm2_artifact: Path) -> None:
    code = first_python_example()
    engine = make_engine(smollm2_artifact, kv_cache_memory="512MiB")
    with serve({"smollm2-135m": engine}) as server:
        code = code.replace("http://localhost:8000/v1", f"{server.url}/v1")
        # The SDK's own limits, tightened: a runaway reply fails here instead of retrying.
        code = code.replace('api_key="unused")', 'api_key="unused", timeout=300, max_retries=0)')
        out = io.StringIO()
        names: dict[str, object] = {}
        start = time.perf_counter()
        with contextlib.redirect_stdout(out):
            exec(compile(code, "README.md", "exec"), names)  # noqa: S102 - the README's own example
        elapsed = time.perf_counter() - start
    answer = out.getvalue().strip()
    assert answer, "the example printed nothing"
    reply = names["reply"]
    # The reply is bounded (what keeps it short whatever the sampler draws) ...
    assert reply.usage.completion_tokens <= 64  # type: ignore[attr-defined]
    # ... and quick: under a second on an idle laptop; the bound is for a loaded 2-core CI machine.
    assert elapsed < 120, f"the README example took {elapsed:.1f} s"
    # It prints what the README promises (greedy, so every run): the comment on the print line.
    (promised,) = re.findall(r"^print\(.*\)  # (.+)$", code, flags=re.MULTILINE)
    assert answer == promised.strip(), (answer, promised)
