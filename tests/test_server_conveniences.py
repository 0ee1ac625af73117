"""engine-serve conveniences: /tokenize and /detokenize, the checkpoint's sampling defaults,
--chat-template, --no-cuda-graphs, TLS and CORS."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import conveniences_support
import httpx
import pytest
from click.testing import CliRunner
from server_support import make_engine, serve

from pagecast.runtime.cli import main as engine_serve
from pagecast.runtime.sampling_params import SamplingParams

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(autouse=True)
def _restore_logging(restore_root_logging):  # type: ignore[no-untyped-def]
    """main() installs its own root log handler; conftest puts it back after each test."""


@pytest.fixture(scope="module")
def server(tiny_llama_artifact: Path):  # type: ignore[no-untyped-def]
    engine = make_engine(tiny_llama_artifact)
    with serve({"tiny": engine}, api_key="k") as running:
        yield running


def _post(server: Any, path: str, body: dict[str, Any], key: str | None = "k") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


# -- /tokenize and /detokenize -------------------------------------------------------------------


def test_tokenize_a_prompt_as_completions_does(server: Any) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(server_tokenizer_dir(server)))
    r = _post(server, "/tokenize", {"model": "tiny", "prompt": "The capital of France is", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    expected = tokenizer.encode("The capital of France is", add_special_tokens=False)
    assert body["tokens"] == expected and body["count"] == len(expected)
    assert body["max_model_len"] == server.server.config.app.state.server.models["tiny"].engine.max_model_len
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(expected)
    # The count is what /v1/completions bills for the same prompt.
    c = _post(server, "/v1/completions", {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 1})
    assert c.json()["usage"]["prompt_tokens"] == body["count"]


def test_tokenize_messages_as_chat_completions_renders_them(server: Any) -> None:
    r = _post(server, "/tokenize", {"model": "tiny", "messages": CONVERSATION})
    assert r.status_code == 200, r.text
    chat = _post(
        server,
        "/v1/chat/completions",
        {"model": "tiny", "messages": CONVERSATION, "max_tokens": 1, "return_token_ids": True},
    ).json()
    assert r.json()["tokens"] == chat["prompt_token_ids"]
    assert r.json()["token_strs"] is None


PREFILLED = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My answer is"}]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


def test_chat_continues_a_prefilled_final_message(server: Any) -> None:
    """vLLM's continue_final_message through the openai SDK: the prompt is transformers' rendering
    with the final message left open, and the reply is the continuation of that prompt."""
    import openai
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(server_tokenizer_dir(server)))
    text = tokenizer.apply_chat_template(PREFILLED, tokenize=False, continue_final_message=True)
    expected = tokenizer.encode(text, add_special_tokens=False)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="k", max_retries=0, timeout=60)
    reply = client.chat.completions.create(
        model="tiny", messages=PREFILLED, max_tokens=6, temperature=0, extra_body={**CONTINUE, "return_token_ids": True}
    )
    assert reply.model_extra["prompt_token_ids"] == expected
    assert tokenizer.decode(expected).endswith("<|im_start|>assistant\nMy answer is")
    continued = client.completions.create(model="tiny", prompt=expected, max_tokens=6, temperature=0)
    assert reply.choices[0].message.content == continued.choices[0].text
    # /tokenize renders it the same way
    r = _post(server, "/tokenize", {"model": "tiny", "messages": PREFILLED, **CONTINUE})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == expected
    closed = _post(server, "/tokenize", {"model": "tiny", "messages": PREFILLED, "add_generation_prompt": False})
    assert closed.json()["tokens"] != expected  # the assistant's turn closed: not a continuation


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"continue_final_message": True}, "continue_final_message"),  # with the default generation prompt
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"not a name": 1}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_chat_template_options_that_cannot_work_are_400s(
    server: Any, path: str, extra: dict[str, Any], param: str
) -> None:
    r = _post(server, path, {"model": "tiny", "messages": PREFILLED, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.fixture(scope="module")
def thinking_server(tiny_llama_artifact: Path):  # type: ignore[no-untyped-def]
    """A served model whose chat template reads ``enable_thinking``, as Qwen3's does."""
    from pagecast.runtime.server.chat_template import use_chat_template

    engine = make_engine(tiny_llama_artifact)
    use_chat_template(
        {"tiny": engine},
        "{% set ns = namespace(turns=0) %}"  # as Qwen3's template keeps its state
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}",
    )
    with serve({"tiny": engine}) as running:
        yield running


def test_chat_template_kwargs_reach_the_template(thinking_server: Any) -> None:
    import openai

    messages = [{"role": "user", "content": "Hi"}]
    client = openai.OpenAI(base_url=f"{thinking_server.url}/v1", api_key="unused", max_retries=0, timeout=60)

    def prompt(**extra: Any) -> list[int]:
        r = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=1, extra_body={"return_token_ids": True, **extra}
        )
        return r.model_extra["prompt_token_ids"]  # type: ignore[no-any-return]

    tokenizer = thinking_server.server.config.app.state.server.models["tiny"].engine.tokenizer
    off = prompt(chat_template_kwargs={"enable_thinking": False})
    assert tokenizer.decode(off).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tokenizer.decode(prompt()).endswith("<|im_start|>assistant\n")
    assert prompt(chat_template_kwargs={"enable_thinking": True}) == prompt()
    tokenized = httpx.post(
        f"{thinking_server.url}/tokenize",
        json={"messages": messages, "chat_template_kwargs": {"enable_thinking": False}},
        timeout=60,
    )
    assert tokenized.json()["tokens"] == off
    # a kwarg that shadows what the template calls breaks it: a 400 naming the field, not a 500
    broken = httpx.post(
        f"{thinking_server.url}/v1/chat/completions",
        json={"model": "tiny", "messages": messages, "chat_template_kwargs": {"namespace": 1}},
        timeout=60,
    )
    assert broken.status_code == 400, broken.text
    assert broken.json()["error"]["param"] == "chat_template_kwargs"


def test_detokenize_inverts_tokenize(server: Any) -> None:
    text = "Paged attention, with a KV cache."
    tokens = _post(server, "/tokenize", {"prompt": text}).json()["tokens"]
    r = _post(server, "/detokenize", {"model": "tiny", "tokens": tokens})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": text}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": "a", "messages": CONVERSATION}, 400, None),
        ("/tokenize", {}, 400, None),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens[1]"),
        ("/detokenize", {"tokens": [1, -1]}, 400, "tokens[1]"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
        ("/detokenize", {"model": "nope", "tokens": [1]}, 404, None),
    ],
)
def test_tokenize_errors_are_openai_shaped(server: Any, path: str, body: dict[str, Any], status: int, param: str | None) -> None:
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param


def test_tokenize_needs_the_api_key(server: Any) -> None:
    assert _post(server, "/tokenize", {"prompt": "a"}, key=None).status_code == 401
    assert _post(server, "/detokenize", {"tokens": [1]}, key="wrong").status_code == 401


def server_tokenizer_dir(server: Any) -> Path:
    state = server.server.config.app.state.server
    return Path(state.models["tiny"].engine.tokenizer.name_or_path)


# -- the checkpoint's sampling defaults on the server ------------------------------------------


@pytest.fixture(scope="module")
def defaults_server(tiny_llama_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A server whose artifact's generation config samples from the top token only and
    stops at 7 new tokens (conveniences_support.SAMPLING_DEFAULTS)."""
    artifact = conveniences_support.defaults_artifact(tiny_llama_checkpoint, tmp_path_factory)
    with serve({"tiny": make_engine(artifact)}) as running:
        yield running


def _tokens(server: Any, path: str, body: dict[str, Any]) -> list[int]:
    r = _post(server, path, {"model": "tiny", "return_token_ids": True, **body}, key=None)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]  # type: ignore[no-any-return]


def test_server_applies_generation_defaults_unless_the_request_sets_them(defaults_server: Any) -> None:
    prompt = "The capital of France is"
    greedy = _tokens(defaults_server, "/v1/completions", {"prompt": prompt, "temperature": 0, "max_tokens": 16})
    # top_k defaults to 1: sampling at temperature 1 is greedy.
    sampled = _tokens(defaults_server, "/v1/completions", {"prompt": prompt, "temperature": 1.0, "seed": 3})
    assert sampled == greedy[: len(sampled)] and len(sampled) == len(greedy)  # completions keep max_tokens 16
    # A request that sets top_k gets its own: the tiny random model's next-token distribution
    # is nearly flat, so seeded sampling from all tokens leaves the greedy path at once.
    own = _tokens(defaults_server, "/v1/completions", {"prompt": prompt, "temperature": 1.0, "top_k": 0, "seed": 3})
    assert own != greedy[: len(own)]
    # Chat without max_tokens takes the generation config's max_new_tokens (7).
    chat = _tokens(defaults_server, "/v1/chat/completions", {"messages": CONVERSATION})
    assert len(chat) <= 7
    assert len(_tokens(defaults_server, "/v1/chat/completions", {"messages": CONVERSATION, "max_tokens": 12})) > 7


def test_for_request_fills_only_unset_fields() -> None:
    from pagecast.runtime.generation_config import for_request

    @dataclass
    class Request:
        temperature: float | None = None
        top_p: float | None = 0.5
        top_k: int | None = None
        min_p: float | None = None
        repetition_penalty: float | None = None

    class Engine:
        max_model_len = 100

        @property
        def generation_defaults(self) -> dict[str, Any]:
            return {"temperature": 0.6, "top_p": 0.9, "max_tokens": 64}

    params = for_request(SamplingParams(top_p=0.5, max_tokens=None), Request(), Engine(), [80])
    assert (params.temperature, params.top_p, params.max_tokens) == (0.6, 0.5, 20)  # room left: 100 - 80
    explicit = for_request(SamplingParams(top_p=0.5, max_tokens=3), Request(), Engine(), [80])
    assert explicit.max_tokens == 3


# -- engine-serve options ----------------------------------------------------------------------------


def test_no_cuda_graphs_reaches_the_engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from pagecast.runtime import cli

    seen: dict[str, Any] = {}

    def fake_load(artifacts: Any, names: Any, options: dict[str, Any]) -> dict[str, Any]:
        seen.update(options)
        raise SystemExit(0)

    monkeypatch.setattr(cli, "_load_engines", fake_load)
    assert CliRunner().invoke(engine_serve, [str(tmp_path), "--no-cuda-graphs"]).exit_code == 0
    assert seen["cuda_graphs"] is False
    seen.clear()
    assert CliRunner().invoke(engine_serve, [str(tmp_path)]).exit_code == 0
    assert "cuda_graphs" not in seen  # the engine's default (on)


def test_bad_chat_template_stops_before_loading(tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }")
    result = CliRunner().invoke(engine_serve, [str(tmp_path / "artifact"), "--chat-template", str(template)])
    assert result.exit_code == 2
    assert "--chat-template" in result.output and "not valid Jinja" in result.output
    missing = CliRunner().invoke(engine_serve, [str(tmp_path), "--chat-template", str(tmp_path / "none.jinja")])
    assert missing.exit_code == 2


def test_tls_needs_key_and_certificate(tmp_path: Path) -> None:
    cert = tmp_path / "cert.pem"
    cert.write_text("x")
    result = CliRunner().invoke(engine_serve, [str(tmp_path), "--ssl-certfile", str(cert)])
    assert result.exit_code == 2 and "--ssl-keyfile" in result.output


def test_cors_preflight_and_headers(tiny_llama_artifact: Path) -> None:
    from server_support import ServerThread

    from pagecast.runtime.server.app import add_cors, create_app

    app = create_app({"tiny": make_engine(tiny_llama_artifact)}, api_key="k")
    add_cors(app, ["https://app.example"])
    server = ServerThread(app).start()
    try:
        preflight = httpx.options(
            f"{server.url}/v1/completions",
            headers={
                "Origin": "https://app.example",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type",
            },
        )
        assert preflight.status_code == 200  # answered before the API-key check
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        r = httpx.get(f"{server.url}/health", headers={"Origin": "https://app.example"})
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        other = httpx.get(f"{server.url}/health", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers
    finally:
        server.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_engine_serve_with_tls_cors_and_chat_template(tiny_llama_artifact: Path, tmp_path: Path) -> None:
    """The real command line: HTTPS with a self-signed certificate, CORS headers, and the
    chat template from a file applied to /v1/chat/completions and /tokenize."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is needed to make a test certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
    port = _free_port()
    cmd = [
        sys.executable, "-m", "pagecast.runtime.cli", str(tiny_llama_artifact), "--port", str(port),
        "--kv-cache-memory", "16MiB", "--no-cuda-graphs", "--chat-template", str(template),
        "--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
        "--allowed-origins", "https://a.example,https://b.example",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    url = f"https://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", verify=str(cert), timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "engine-serve did not start"
            time.sleep(0.2)
        with pytest.raises(httpx.TransportError):  # plain HTTP is not served
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        r = httpx.post(
            f"{url}/tokenize",
            json={"messages": [{"role": "user", "content": "Hi"}]},
            headers={"Origin": "https://b.example"},
            verify=str(cert),
            timeout=30,
        )
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == "https://b.example"
        detok = httpx.post(f"{url}/detokenize", json={"tokens": r.json()["tokens"]}, verify=str(cert), timeout=30)
        assert detok.json()["prompt"] == "<user>Hi<assistant>"
        chat = httpx.post(
            f"{url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
            verify=str(cert),
            timeout=60,
        )
        assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == r.json()["count"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    assert proc.returncode == 0
