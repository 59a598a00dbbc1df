"""The OpenAI-compatible HTTP API: a FastAPI app served by uvicorn in the api process's loop.

Endpoints (request and response shapes as OpenAI's and vLLM's servers):

| method, path | what |
|---|---|
| ``POST /v1/completions`` | text completions, streamed (SSE) or not |
| ``POST /v1/chat/completions`` | chat completions, streamed (SSE) or not |
| ``GET /v1/models`` | the served model (``id`` = ``--served-model-name``) |
| ``GET /health`` | 200 once the engine is ready, 503 while starting, shutting down or lost |
| ``POST /tokenize``, ``POST /detokenize`` | the tokenizer (vLLM's shapes) |

The port is bound at start-up, before the engine is ready: until then every
endpoint answers 503 (``the server is starting``). Errors use OpenAI's body,
``{"error": {"message", "type", "param", "code"}}``, with ``param`` naming the
offending field: 400 bad input (including a body that is not JSON, a wrong
type, an unknown or unsupported field), 401 a missing or wrong API key, 404 an
unknown model, 429 the waiting queue is full, 503 not serving.

A client that disconnects — mid-stream, or while waiting for a whole
response — has its requests aborted, which frees their KV blocks.

With ``api_key`` set, every path except ``/health`` needs
``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from jaxserve.api.openai.protocol import (FIELD_NAMES, ChatCompletionRequest,
                                          CompletionRequest, DetokenizeRequest, TokenizeRequest)
from jaxserve.api.openai.responses import OpenAIResult, error_body, http_status
from jaxserve.api.openai.serving import OpenAIServing, check_model
from jaxserve.api.runner import ApiError, RequestRunner
from jaxserve.api.tool_parsers import tool_parser as tool_parser_named
from jaxserve.validation import check_token_ids

_OPEN_PATHS = ("/health",)  # reachable without the API key (probes)


class HttpFrontEnd:
    """The HTTP API's state: the runner once the engine is ready.

    Args:
      api_key: required as ``Authorization: Bearer <key>``, or None for none.
      tool_parser: the ``--tool-call-parser`` name when ``--enable-auto-tool-choice``
        is on (``jaxserve.api.tool_parsers.PARSERS``), else None.

    Raises:
      ValueError: an unknown ``tool_parser``.
    """

    def __init__(self, api_key: str | None = None, tool_parser: str | None = None) -> None:
        self.api_key = api_key
        self.tool_parser = tool_parser and tool_parser_named(tool_parser)
        self.serving: OpenAIServing | None = None
        self.app = build_app(self)

    def attach(self, runner: RequestRunner) -> None:
        """Starts serving requests through ``runner`` (the engine is ready)."""
        self.serving = OpenAIServing(runner, tool_parser=self.tool_parser)

    def _serving(self) -> OpenAIServing:
        if self.serving is None:
            raise ApiError(grpc.StatusCode.UNAVAILABLE,
                           "the server is starting: the engine is not ready yet")
        return self.serving


def _error(err: ApiError) -> JSONResponse:
    headers = {}
    if err.code == grpc.StatusCode.UNAUTHENTICATED:
        headers["WWW-Authenticate"] = "Bearer"
    elif err.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        headers["Retry-After"] = "1"
    return JSONResponse(error_body(err), status_code=http_status(err), headers=headers)


def bearer_token_matches(header: str, key: str) -> bool:
    """``header`` is ``Bearer <key>`` (the scheme case-insensitive, RFC 7235); constant time."""
    scheme, _, token = header.strip().partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(),
                                                                 key.encode())


def _param(loc: tuple[Any, ...], *, unknown_field: bool = False) -> str | None:
    """A pydantic error location as a parameter path, or None for the whole body.

    ``("body", "messages", 0, "content", "list[dict[str,any]]", 0)`` ->
    ``"messages[0].content[0]"``: list indices are kept, and so are the parts
    that are field names of the request models (``protocol.FIELD_NAMES``);
    the others — pydantic's union member tags, dict keys — are dropped. With
    ``unknown_field`` (an ``extra_forbidden`` error) the last part is the
    unknown field's name and is kept.
    """
    parts = loc[1:] if loc[:1] == ("body",) else loc
    name = ""
    for i, part in enumerate(parts):
        if isinstance(part, int):
            name += f"[{part}]"
        elif part in FIELD_NAMES or (unknown_field and i == len(parts) - 1):
            name += ("." if name else "") + str(part)
    return name or None


async def _until_disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _EventStream(StreamingResponse):
    """An SSE response that closes its requests however it ends (even never started)."""

    def __init__(self, result: OpenAIResult) -> None:
        super().__init__(result.events(), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._result = result

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._result.close()


async def _whole(request: Request, result: OpenAIResult) -> Response:
    """The whole response, or nothing if the client disconnects first (its requests aborted)."""
    body = asyncio.ensure_future(result.body())
    gone = asyncio.ensure_future(_until_disconnected(request.receive))
    try:
        await asyncio.wait({body, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not body.done():
            body.cancel()
            return Response(status_code=499)
        return JSONResponse(body.result())
    finally:
        gone.cancel()
        result.close()


def build_app(front: HttpFrontEnd) -> FastAPI:
    """The FastAPI app of ``front`` (see the module docstring)."""
    app = FastAPI(title="jaxserve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def authenticate(request: Request,
                           call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if front.api_key is not None and request.url.path not in _OPEN_PATHS:
            if not bearer_token_matches(request.headers.get("authorization", ""), front.api_key):
                return _error(ApiError(grpc.StatusCode.UNAUTHENTICATED,
                                       "a valid API key is required (Authorization: Bearer "
                                       "<key>)"))
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        return _error(err)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0]
        if first.get("type") == "json_invalid":
            message, param = f"the request body is not valid JSON: {first.get('msg')}", None
        elif tuple(first.get("loc", ())) == ("body",):
            message, param = ("the request body must be a JSON object (send Content-Type: "
                              "application/json)"), None
        else:
            param = _param(tuple(first.get("loc", ())),
                           unknown_field=first.get("type") == "extra_forbidden")
            message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        if front.serving is not None:
            front.serving.runner.metrics.rejected.labels(code="INVALID_ARGUMENT").inc()
        return _error(ApiError(grpc.StatusCode.INVALID_ARGUMENT, message, param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(err.status_code,
                                                                        "invalid_request_error")
        return JSONResponse({"error": {"message": str(err.detail), "type": kind, "param": None,
                                       "code": err.status_code}}, status_code=err.status_code)

    @app.get("/health")
    async def health() -> Response:
        serving = front._serving()
        if not serving.runner.ready:
            raise ApiError(grpc.StatusCode.UNAVAILABLE,
                           serving.runner.engine.error or "the server is shutting down")
        return Response(status_code=200)

    created = int(time.time())  # the model card's time: when this server started, not per call

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        runner = front._serving().runner
        return {"object": "list", "data": [{
            "id": runner.model_name, "object": "model", "created": created,
            "owned_by": "jaxserve", "max_model_len": runner.preparer.limits.max_model_len}]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        check_model(front._serving().runner, model_id)  # 404 for any other name
        (entry,) = (await models())["data"]
        return entry

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        result = await front._serving().completions(body)
        return _EventStream(result) if body.stream else await _whole(request, result)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        result = await front._serving().chat_completions(body)
        return _EventStream(result) if body.stream else await _whole(request, result)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        serving = front._serving()
        runner = serving.runner
        check_model(runner, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(grpc.StatusCode.INVALID_ARGUMENT,
                           "prompt: set one of prompt or messages", "prompt")
        if body.prompt is not None:
            ids = list(serving.tokenizer.encode(body.prompt,
                                                add_special_tokens=body.add_special_tokens))
        else:
            ids = serving.chat_prompt(ChatCompletionRequest(
                messages=body.messages, add_generation_prompt=body.add_generation_prompt))
        return {"count": len(ids), "max_model_len": runner.preparer.limits.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        serving = front._serving()
        runner = serving.runner
        check_model(runner, body.model)
        with runner.preparer_errors():
            check_token_ids(body.tokens, vocab_size=runner.preparer.limits.vocab_size, field="tokens")
        return {"prompt": serving.tokenizer.decode(body.tokens)}

    return app


class HttpServer(uvicorn.Server):
    """uvicorn's server run as a task in the api process's own event loop.

    The api process owns the signal handlers, so uvicorn does not install its
    own; ``stop()`` asks it to exit (closing the listening socket, then
    waiting up to ``timeout_graceful_shutdown`` for open connections).
    """

    @contextlib.contextmanager
    def capture_signals(self):  # noqa: D102 - the api process handles signals
        yield

    def stop(self) -> None:
        self.should_exit = True


def http_server(front: HttpFrontEnd, *, host: str, port: int, ssl_certfile: str | None = None,
                ssl_keyfile: str | None = None,
                shutdown_grace: float = 2.0) -> tuple[HttpServer, socket.socket]:
    """A uvicorn server for ``front.app`` and its socket, bound now to ``host:port``.

    Serve with ``await server.serve(sockets=[sock])``; TLS when both files are given.

    Raises:
      RuntimeError: the port cannot be bound (the message names it).
    """
    config = uvicorn.Config(front.app, host=host, port=port, log_level="warning",
                            access_log=False, ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile,
                            timeout_graceful_shutdown=max(shutdown_grace, 0.1),
                            lifespan="off")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise RuntimeError(f"--http-port {port}: cannot listen on {host}:{port}: "
                           f"{err.strerror}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return HttpServer(config), sock
