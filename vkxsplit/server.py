"""``vkxsplit serve``: an OpenAI-compatible HTTP server for one model, on starlette + uvicorn.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (both with ``stream`` as
server-sent events), ``GET /v1/models``, ``GET /health``, and a small chat page at ``/``
(``vkxsplit/static/chat.html``). Requests are queued: one model, one generation at a time (an
asyncio lock in front of one worker thread that runs every model call); a request waits its
turn. Any ``model`` name is accepted (there is one). Bad requests get OpenAI's error body,
``{"error": {"message", "type", "param", "code"}}``, with a 4xx status.

Request fields: ``messages`` / ``prompt``, ``max_tokens`` (or ``max_completion_tokens``; absent:
the server's ``-n``, by default until the end of generation or a full context), ``temperature``, ``top_p``, ``seed``, ``stop``
(a string or up to 4), ``stream``, ``stream_options.include_usage``, ``n`` (1 only), and
llama-server's extensions ``top_k``, ``min_p``, ``repeat_penalty``. Defaults: the
server's command line, which defaults to :mod:`vkxsplit.defaults`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from typing import Any

from .errors import EnvironmentProblem, VkxError

MAX_STOP = 4


class RequestError(Exception):
    """A request the server refuses: the status and OpenAI's error fields."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _number(body: dict[str, Any], key: str, lo: float, hi: float, default: Any, integer: bool = False,
            lo_open: bool = False) -> Any:
    v = body.get(key)
    if v is None:
        return default
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or v != v or v < lo or v > hi or (lo_open and v == lo):
        kind = "an integer" if integer else "a number"
        lo_s = ("(" if lo_open else "[") + f"{lo:g}"
        raise RequestError(f"'{key}' must be {kind} in {lo_s}, {hi:g}], got {v!r}", key)
    return v


class Job:
    """One request's generation parameters, checked."""

    def __init__(self, body: Any, chat: bool, sampling: dict[str, Any]) -> None:
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise RequestError("'messages' must be a non-empty array of {role, content} objects", "messages")
            self.messages = [self._message(m, i) for i, m in enumerate(msgs)]
            self.prompt: str | None = None
        else:
            p = body.get("prompt")
            if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
                p = p[0]
            if not isinstance(p, str):
                raise RequestError("'prompt' must be a string (one prompt per request)", "prompt")
            self.prompt, self.messages = p, []
        if body.get("n") not in (None, 1):
            raise RequestError("'n' must be 1: one choice per request", "n")
        mt = body.get("max_completion_tokens", body.get("max_tokens"))
        key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        self.max_tokens = sampling.get("n_predict", -1) if mt is None else \
            _number({key: mt}, key, 1, 1 << 30, None, integer=True)
        self.temperature = _number(body, "temperature", 0, 2, sampling["temperature"])
        self.top_p = _number(body, "top_p", 0, 1, sampling["top_p"], lo_open=True)
        self.top_k = _number(body, "top_k", 0, 1 << 30, sampling["top_k"], integer=True)
        self.min_p = _number(body, "min_p", 0, 1, sampling["min_p"])
        self.repeat_penalty = _number(body, "repeat_penalty", 0, 100, sampling["repeat_penalty"], lo_open=True)
        self.seed = _number(body, "seed", -(1 << 63), (1 << 64) - 1, sampling.get("seed"), integer=True)
        if self.seed is not None and self.seed < 0:
            self.seed = None  # OpenAI clients send -1 for "random"
        stop = body.get("stop")
        if stop is None:
            self.stop: list[str] = []
        elif isinstance(stop, str):
            self.stop = [stop] if stop else []
        elif isinstance(stop, list) and len(stop) <= MAX_STOP and all(isinstance(s, str) for s in stop):
            self.stop = [s for s in stop if s]
        else:
            raise RequestError(f"'stop' must be a string or an array of at most {MAX_STOP} strings", "stop")
        self.stream = body.get("stream", False)
        if not isinstance(self.stream, bool):
            raise RequestError("'stream' must be true or false", "stream")
        so = body.get("stream_options")
        so = {} if so is None else so
        if not isinstance(so, dict):
            raise RequestError("'stream_options' must be an object", "stream_options")
        self.include_usage = so.get("include_usage", False)
        if not isinstance(self.include_usage, bool):
            raise RequestError("'stream_options.include_usage' must be true or false", "stream_options")
        self.finish = "length"
        self.usage: dict[str, int] = {}
        self.model = body.get("model")
        if self.model is not None and not isinstance(self.model, str):
            raise RequestError("'model' must be a string", "model")

    @staticmethod
    def _message(m: Any, i: int) -> dict[str, str]:
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"{where} must be an object with a 'role' and a 'content'", where)
        if m["role"] not in ("system", "developer", "user", "assistant"):
            raise RequestError(f"{where}.role {m['role']!r} is not system, developer, user or assistant",
                               f"{where}.role")
        c = m.get("content")
        if isinstance(c, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in c):
                raise RequestError(f"{where}.content: only text parts are supported", f"{where}.content")
            c = "".join(p["text"] for p in c)
        if not isinstance(c, str):
            raise RequestError(f"{where}.content must be a string", f"{where}.content")
        role = "system" if m["role"] == "developer" else m["role"]
        return {"role": role, "content": c}


class StopScan:
    """Text pieces in, text out with the stop strings cut: holds back what could be the start
    of a stop string until it is known not to be one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.buf = ""
        self.hit = False

    def push(self, piece: str) -> str:
        self.buf += piece
        if not self.stops:
            out, self.buf = self.buf, ""
            return out
        cut = min((i for i in (self.buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.buf, self.hit = self.buf[:cut], "", True
            return out
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.buf)), 0, -1):
                if self.buf.endswith(s[:k]):
                    keep = max(keep, k)
                    break
        out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return out

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


class Server:
    """The model, its worker thread and the queue in front of it."""

    def __init__(self, model: Any, model_id: str, sampling: dict[str, Any]) -> None:
        self.model = model
        self.model_id = model_id
        self.sampling = sampling
        self.created = int(time.time())
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vkxsplit-model")
        self.lock = asyncio.Lock()

    def ids(self, job: Job) -> list[int]:
        m = self.model
        try:
            ids = m.chat_ids(job.messages if job.prompt is None else job.prompt, chat=None if job.prompt is None
                             else False)
        except VkxError as exc:
            raise RequestError(f"the prompt cannot be tokenized: {exc}", "messages" if job.prompt is None
                               else "prompt") from None
        if not ids:
            raise RequestError("the prompt is empty", "prompt")
        if len(ids) >= m.n_ctx:
            raise RequestError(f"the prompt has {len(ids)} tokens; the context holds {m.n_ctx}",
                               "messages" if job.prompt is None else "prompt", code="context_length_exceeded")
        return ids

    def generate(self, job: Job, ids: list[int], cancel: threading.Event) -> Iterator[str]:
        """Text pieces (stop strings cut), on the worker thread; then ``job.finish`` says why it
        ended and ``job.usage`` counts the tokens."""
        m = self.model
        scan = StopScan(job.stop)
        gen = m.tokenizer.decode_stream(m.generate_ids(
            ids, job.max_tokens, temperature=job.temperature, top_k=job.top_k, top_p=job.top_p, seed=job.seed,
            min_p=job.min_p, repeat_penalty=job.repeat_penalty, repeat_last_n=self.sampling["repeat_last_n"]))
        try:
            for piece in gen:
                text = scan.push(piece)
                if text:
                    yield text
                if scan.hit or cancel.is_set():
                    break
        finally:
            gen.close()
        if not scan.hit:
            tail = scan.flush()
            if tail:
                yield tail
        t = m.timings
        job.finish = "stop" if scan.hit or t.get("stop") == "eos" else "length"
        job.usage = {"prompt_tokens": len(ids), "completion_tokens": int(t.get("gen_tokens", 0)),
                      "total_tokens": len(ids) + int(t.get("gen_tokens", 0))}

    async def run(self, job: Job) -> AsyncIterator[str]:
        """The job's text pieces, in its turn of the queue."""
        loop = asyncio.get_running_loop()
        async with self.lock:
            ids = await loop.run_in_executor(self.worker, self.ids, job)
            queue: asyncio.Queue[Any] = asyncio.Queue()
            cancel = threading.Event()
            end = object()

            def produce() -> None:
                try:
                    for piece in self.generate(job, ids, cancel):
                        loop.call_soon_threadsafe(queue.put_nowait, piece)
                except BaseException as exc:  # noqa: BLE001  (handed to the request)
                    loop.call_soon_threadsafe(queue.put_nowait, exc)
                loop.call_soon_threadsafe(queue.put_nowait, end)

            fut = loop.run_in_executor(self.worker, produce)
            try:
                while True:
                    item = await queue.get()
                    if item is end:
                        break
                    if isinstance(item, BaseException):
                        raise item
                    yield item
            finally:
                cancel.set()  # a client that went away stops the generation at the next token
                await asyncio.shield(fut)


def _error(exc: RequestError) -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse(exc.body(), status_code=exc.status)


def create_app(model: Any, model_id: str = "vkxsplit", sampling: dict[str, Any] | None = None) -> Any:
    """The starlette app serving ``model`` (a loaded :class:`vkxsplit.model.LanguageModel`);
    ``sampling``: the defaults of requests that do not say (temperature, top_k, top_p, min_p,
    repeat_penalty, repeat_last_n, seed, and n_predict: the tokens of a request without
    max_tokens, -1 = until the end of generation or a full context)."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    from . import defaults

    s = defaults.SAMPLING
    samp = {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p,
            "repeat_penalty": s.repeat_penalty, "repeat_last_n": s.repeat_last_n, "seed": None,
            "n_predict": defaults.N_PREDICT}
    samp.update(sampling or {})
    srv = Server(model, model_id, samp)
    page = resources.files("vkxsplit").joinpath("static/chat.html").read_text(encoding="utf-8")

    async def index(request: Request) -> Any:
        return HTMLResponse(page)

    async def health(request: Request) -> Any:
        return JSONResponse({"status": "ok"})

    async def models(request: Request) -> Any:
        return JSONResponse({"object": "list", "data": [
            {"id": srv.model_id, "object": "model", "created": srv.created, "owned_by": "vkxsplit",
             "meta": {"n_ctx": model.n_ctx, "n_vocab": model.hp.n_vocab}}]})

    async def read_job(request: Request, chat: bool) -> Job:
        try:
            body = json.loads(await request.body() or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(f"the request body is not JSON: {exc}") from None
        except RecursionError:  # (arrays or objects nested thousands deep)
            raise RequestError("the request body nests too deeply to be a request") from None
        return Job(body, chat, srv.sampling)

    def completion(chat: bool) -> Any:
        async def handler(request: Request) -> Any:
            try:
                job = await read_job(request, chat)
            except RequestError as exc:
                return _error(exc)
            rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
            created = int(time.time())
            obj = "chat.completion" if chat else "text_completion"
            pieces = srv.run(job)
            try:  # the first piece (or the request's error) before any header is sent
                first: str | None = await pieces.__anext__()
            except StopAsyncIteration:
                first = None
            except RequestError as exc:
                return _error(exc)
            except VkxError as exc:
                return _error(RequestError(str(exc), status=500, type_="server_error"))

            def choice(text: str | None, finish: str | None, delta: bool) -> dict[str, Any]:
                if chat:
                    key = "delta" if delta else "message"
                    msg: dict[str, Any] = {} if text is None else {"content": text}
                    if not delta:
                        msg = {"role": "assistant", "content": text or ""}
                    return {"index": 0, key: msg, "finish_reason": finish, "logprobs": None}
                return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}

            def envelope(choices: list[Any], **extra: Any) -> dict[str, Any]:
                return {"id": rid, "object": obj + (".chunk" if job.stream and chat else ""), "created": created,
                        "model": job.model or srv.model_id, "system_fingerprint": "vkxsplit",
                        "choices": choices, **extra}

            if not job.stream:
                parts = [] if first is None else [first]
                try:
                    async for p in pieces:
                        parts.append(p)
                        if await request.is_disconnected():  # nobody to answer: stop, free the queue
                            await pieces.aclose()
                            return Response(status_code=499)
                except VkxError as exc:
                    return _error(RequestError(str(exc), status=500, type_="server_error"))
                return JSONResponse(envelope([choice("".join(parts), job.finish, False)], usage=job.usage))

            async def events() -> AsyncIterator[str]:
                try:
                    if chat:
                        yield "data: " + json.dumps(envelope([{"index": 0, "delta": {"role": "assistant",
                                                                                      "content": ""},
                                                               "finish_reason": None, "logprobs": None}])) + "\n\n"
                    if first is not None:
                        yield "data: " + json.dumps(envelope([choice(first, None, True)])) + "\n\n"
                    async for p in pieces:
                        yield "data: " + json.dumps(envelope([choice(p, None, True)])) + "\n\n"
                    yield "data: " + json.dumps(envelope([choice(None if chat else "", job.finish, True)])) + "\n\n"
                    if job.include_usage:
                        yield "data: " + json.dumps(envelope([], usage=job.usage)) + "\n\n"
                except VkxError as exc:
                    yield "data: " + json.dumps(RequestError(str(exc), status=500, type_="server_error").body()) \
                        + "\n\n"
                finally:
                    await pieces.aclose()
                yield "data: [DONE]\n\n"

            return Stream(events(), media_type="text/event-stream",
                          headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        return handler

    class Stream(StreamingResponse):
        """A streamed answer that closes its events however the response ends: a server on ASGI
        spec 2.4 reports a client gone mid-stream by a failing send (starlette raises
        ClientDisconnect), which leaves the events generator suspended; closed here, its
        ``finally`` stops the generation and frees the queue for the next request."""

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                await self.body_iterator.aclose()  # type: ignore[attr-defined]

    async def http_error(request: Request, exc: Exception) -> Any:
        assert isinstance(exc, HTTPException)
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "invalid_request_error")
        msg = {404: f"no route {request.url.path} (routes: /v1/chat/completions, /v1/completions, /v1/models, "
                    "/health, /)",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return _error(RequestError(msg, status=exc.status_code, type_=kind))

    app = Starlette(routes=[
        Route("/", index, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", completion(True), methods=["POST"]),
        Route("/v1/completions", completion(False), methods=["POST"]),
    ], exception_handlers={HTTPException: http_error})
    app.state.server = srv
    return app


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn
    except ModuleNotFoundError as exc:
        raise EnvironmentProblem(f"`vkxsplit serve` needs {exc.name}, which is not installed",
                                 "pip install 'vkxsplit[serve]' (tools/setup.sh installs it)") from None
    from .runner import load_from_args, sampling_kwargs

    model = load_from_args(args)
    try:
        samp = dict(sampling_kwargs(args), n_predict=args.n_predict)
        model_id = args.alias or (model.path.stem if hasattr(model, "path") else "vkxsplit")
        app = create_app(model, model_id, samp)
        print(f"vkxsplit: serving {model_id} on http://{args.host}:{args.port}/ (OpenAI API under /v1; "
              "one request at a time, the others wait their turn)", file=sys.stderr)
        try:
            uvicorn.run(app, host=args.host, port=args.port, log_level="warning" if not args.verbose else "info")
        finally:
            app.state.server.worker.shutdown(wait=True)
    finally:
        model.close()
    return 0


def register(sub: Any) -> None:
    from .runner import add_model_args, add_sampling_args, int_at_least

    p = sub.add_parser("serve", allow_abbrev=False,
                       help="an OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions) and a chat page")
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("-n", "--n-predict", "--predict", dest="n_predict", type=int_at_least(-1), default=-1,
                   help="tokens of an answer whose request gives no max_tokens (default -1: until the end of "
                        "generation or a full context)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int_at_least(0), default=8080, help="port (default 8080)")
    p.add_argument("-a", "--alias", default=None, help="the model's name in the API (default: the file's stem)")
    p.set_defaults(func=cmd_serve)


__all__ = ["RequestError", "StopScan", "create_app", "register"]
