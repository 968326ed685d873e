"""``vkxsplit serve`` when clients leave: a client that goes away mid-answer must stop
the generation and free the one-model lock (the next request is served). Driven through the
ASGI interface with a fake model (no GPU work): the fake's generator counts the tokens it made."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import pytest

pytest.importorskip("starlette")

from vkxsplit.server import create_app  # noqa: E402


class _Tok:
    def decode_stream(self, ids: Any) -> Any:
        for i in ids:
            yield f"t{i} "


class FakeModel:
    """Endless generation, one token per 5 ms; ``made`` counts the tokens produced."""

    n_ctx = 4096

    class hp:  # noqa: N801
        n_vocab = 100

    def __init__(self) -> None:
        self.tokenizer = _Tok()
        self.timings: dict[str, Any] = {}
        self.made = 0
        self.lock = threading.Lock()

    def chat_ids(self, msgs: Any, chat: Any = None) -> list[int]:
        return [1, 2, 3]

    def generate_ids(self, ids: list[int], n: int, **kw: Any) -> Any:
        i = 0
        while n < 0 or i < n:
            time.sleep(0.005)
            self.made += 1
            self.timings = {"gen_tokens": self.made}
            yield i % 100
            i += 1


async def _request(app: Any, body: dict[str, Any], disconnect_after: int | None,
                   spec: str = "2.3", leave_after: float | None = None) -> list[dict[str, Any]]:
    """One request through the app; the client goes away after ``disconnect_after`` body
    messages, or ``leave_after`` seconds."""
    sent: list[dict[str, Any]] = []
    gone = asyncio.Event()
    first = True
    if leave_after is not None:
        asyncio.get_running_loop().call_later(leave_after, gone.set)

    async def receive() -> dict[str, Any]:
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        if gone.is_set():  # (uvicorn, ASGI spec 2.3: sends after a disconnect are dropped)
            if spec >= "2.4":  # (spec 2.4: a send to a closed connection raises OSError)
                raise OSError("the client went away")
            return
        sent.append(msg)
        if disconnect_after is not None and msg["type"] == "http.response.body":
            if sum(m["type"] == "http.response.body" for m in sent) >= disconnect_after:
                gone.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    try:
        await asyncio.wait_for(app(scope, receive, send), 20)
    except Exception as exc:  # noqa: BLE001  (starlette's ClientDisconnect: the server handles it)
        if not gone.is_set() or type(exc).__name__ != "ClientDisconnect":
            raise
    return sent


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
def test_a_client_gone_mid_stream_stops_generation_and_frees_the_queue(spec: str) -> None:
    model = FakeModel()
    app = create_app(model, "fake")

    async def scenario() -> tuple[int, int, list[dict[str, Any]]]:
        await _request(app, {"prompt": "hi", "stream": True}, disconnect_after=3, spec=spec)
        at_disconnect = model.made
        await asyncio.sleep(0.5)  # an endless generation would make ~100 more tokens here
        after = model.made
        sent = await _request(app, {"prompt": "hi", "max_tokens": 4}, disconnect_after=None)
        return at_disconnect, after, sent

    at_disconnect, after, sent = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert after - at_disconnect <= 3, (at_disconnect, after)  # stopped at the next token
    assert app.state.server.lock.locked() is False
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert json.loads(body)["choices"][0]["text"] == "t0 t1 t2 t3 "


def test_a_client_gone_before_a_whole_answer_stops_generation_and_frees_the_queue() -> None:
    """Not streamed: the client leaves while the answer is being made (no send tells the
    server); the generation stops at the next token instead of running to a full context."""
    model = FakeModel()
    app = create_app(model, "fake")

    async def scenario() -> tuple[int, int, list[dict[str, Any]]]:
        task = asyncio.ensure_future(_request(app, {"prompt": "hi"}, disconnect_after=None, leave_after=0.1))
        await task
        at_disconnect = model.made
        await asyncio.sleep(0.5)  # an endless generation would make ~100 more tokens here
        after = model.made
        sent = await _request(app, {"prompt": "hi", "max_tokens": 4}, disconnect_after=None)
        return at_disconnect, after, sent

    at_disconnect, after, sent = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert at_disconnect < 200 and after - at_disconnect <= 3, (at_disconnect, after)
    assert app.state.server.lock.locked() is False
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert json.loads(body)["choices"][0]["text"] == "t0 t1 t2 t3 "
