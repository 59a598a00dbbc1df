"""A real gRPC server on loopback with a scripted GenerateService, for the client tests.

The "model" echoes its prompt: each character of the prompt text is one token
(id = its code point), generated one per step. Completion i of n echoes the
prompt rotated left by i characters. ``max_tokens`` cuts it ("length"), a stop
token id or a stop string in it ends it ("stop"), else it ends with EOS
("stop", no stop reason). Prompts starting with ``!`` are commands:

- ``!error CODE message``: abort with that gRPC status and message;
- ``!sleep SECONDS``: wait (until cancelled) before answering;
- ``!forever``: stream a token every 10 ms until the call is cancelled;
- ``!truncate``: end the stream without a final response.

``GetModelInfo`` and ``Tokenize`` answer from fixed values; the server also
serves ``grpc.health.v1`` (with ``NOT_SERVING_SERVICE`` marked not serving).

``FakeServer(starting=True)`` behaves like the api process while it starts:
health NOT_SERVING and Generate ``UNAVAILABLE: the server is starting`` until
``start_serving()``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from jaxserve.proto import generate_pb2 as pb
from jaxserve.proto import generate_pb2_grpc as pb_grpc

SERVICE = "jaxserve.GenerateService"
NOT_SERVING_SERVICE = "jaxserve.Maintenance"
MODEL_INFO = pb.GetModelInfoResponse(model="echo", max_model_len=128, vocab_size=0x110000,
                                     block_size=16, num_kv_blocks_free=7, num_kv_blocks_total=9,
                                     eos_token_ids=[0])


def prompt_text(request: pb.GenerateRequest) -> str:
    kind = request.WhichOneof("prompt")
    if kind == "text":
        return request.text
    if kind == "token_ids":
        return "".join(chr(i) for i in request.token_ids.ids)
    if kind == "chat":
        return "".join(f"{m.role}: {m.content}\n" for m in request.chat.messages)
    return ""


def echo_completion(text: str, index: int, params: pb.SamplingParams) -> tuple[str, str, str | int | None]:
    """(completion text, finish reason, stop reason) of completion ``index``."""
    rotated = text[index:] + text[:index]
    limit = params.max_tokens if params.HasField("max_tokens") else len(rotated)
    for k, char in enumerate(rotated[:limit], start=1):
        if ord(char) in params.stop_token_ids:
            return rotated[:k], "stop", ord(char)
        for stop in params.stop:
            if rotated[:k].endswith(stop):
                return rotated[:k - len(stop)], "stop", stop
    if limit < len(rotated):
        return rotated[:limit], "length", None
    return rotated, "stop", None


def _finished(reason: str, stop: str | int | None, prompt_len: int, n_tokens: int) -> pb.Finished:
    fin = pb.Finished(reason={"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}[reason],
                      prompt_tokens=prompt_len, completion_tokens=n_tokens,
                      cached_prompt_tokens=prompt_len // 2)
    if isinstance(stop, str):
        fin.stop_string = stop
    elif stop is not None:
        fin.stop_token_id = stop
    return fin


def _logprobs(token_id: int, params: pb.SamplingParams) -> list[pb.TokenLogprobs]:
    if not params.HasField("logprobs"):
        return []
    top = [token_id + j for j in range(params.logprobs)]
    return [pb.TokenLogprobs(logprob=-0.5, top_token_ids=top,
                             top_logprobs=[-0.5 - j for j in range(params.logprobs)])]


class ScriptedGenerateServicer(pb_grpc.GenerateServiceServicer):
    """See the module docstring. ``requests`` records every Generate request (``metadata``
    its invocation metadata);
    ``cancelled`` is set when a sleeping or endless call saw its client go away."""

    def __init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []
        self.metadata: list[dict[str, str]] = []  # each Generate call's invocation metadata
        self.cancelled = threading.Event()
        self.serving = threading.Event()
        self.serving.set()

    def Generate(self, request: pb.GenerateRequest,
                 context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        if not self.serving.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          "the server is starting: the engine is not ready yet")
        self.requests.append(request)
        self.metadata.append(dict(context.invocation_metadata()))
        text = prompt_text(request)
        request_id = request.request_id or "fake-1"
        if text.startswith("!error "):
            _, code, message = text.split(" ", 2)
            context.abort(grpc.StatusCode[code], message)
        if text.startswith("!sleep "):
            deadline = time.monotonic() + float(text.split()[1])
            while time.monotonic() < deadline and context.is_active():
                time.sleep(0.01)
            if not context.is_active():
                self.cancelled.set()
                return
            text = "slept"
        if text == "!forever":
            try:  # ends only when the client goes away (the generator is closed or inactive)
                while context.is_active():
                    yield pb.GenerateResponse(request_id=request_id, token_ids=[120], text="x")
                    time.sleep(0.01)
            finally:
                self.cancelled.set()
            return
        if text == "!truncate":
            yield pb.GenerateResponse(request_id=request_id, token_ids=[120], text="x")
            return
        yield from self._echo(request, request_id, text)

    def _echo(self, request: pb.GenerateRequest, request_id: str,
              text: str) -> Iterator[pb.GenerateResponse]:
        params = request.sampling_params
        n = params.n if params.HasField("n") else 1
        outs = [echo_completion(text, i, params) for i in range(n)]
        if not request.stream:
            for i, (out, reason, stop) in enumerate(outs):
                yield pb.GenerateResponse(
                    request_id=request_id, index=i, token_ids=[ord(c) for c in out], text=out,
                    logprobs=[lp for c in out for lp in _logprobs(ord(c), params)],
                    finished=_finished(reason, stop, len(text), len(out)))
            return
        for step in range(max(len(o[0]) for o in outs) + 1):  # completions interleave
            for i, (out, reason, stop) in enumerate(outs):
                if step < len(out):
                    yield pb.GenerateResponse(request_id=request_id, index=i,
                                              token_ids=[ord(out[step])], text=out[step],
                                              logprobs=_logprobs(ord(out[step]), params))
                elif step == len(out):
                    yield pb.GenerateResponse(request_id=request_id, index=i,
                                              finished=_finished(reason, stop, len(text), len(out)))

    def GetModelInfo(self, request: pb.GetModelInfoRequest,
                     context: grpc.ServicerContext) -> pb.GetModelInfoResponse:
        return MODEL_INFO

    def Tokenize(self, request: pb.TokenizeRequest,
                 context: grpc.ServicerContext) -> pb.TokenizeResponse:
        if request.WhichOneof("input") == "chat":
            text = "".join(f"{m.role}: {m.content}\n" for m in request.chat.messages)
            if not request.chat.HasField("add_generation_prompt") or request.chat.add_generation_prompt:
                text += "assistant: "
        else:
            text = request.text
        if not text:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "text: the prompt must not be empty")
        return pb.TokenizeResponse(token_ids=[ord(c) for c in text], text=text)


class FakeServer:
    """Starts the scripted server on 127.0.0.1 (a free port); ``stop()`` ends it.

    Args:
      starting: begin as a starting server (see the module docstring).
    """

    def __init__(self, *, starting: bool = False) -> None:
        self.servicer = ScriptedGenerateServicer()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        pb_grpc.add_GenerateServiceServicer_to_server(self.servicer, self.server)
        self.health = health.HealthServicer()
        self.health.set(NOT_SERVING_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if starting:
            self.servicer.serving.clear()
            for service in ("", SERVICE):
                self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        else:
            self.start_serving()
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.target = f"127.0.0.1:{self.port}"
        self.server.start()

    def start_serving(self) -> None:
        """Generate answers from now on, then health reports SERVING (as the api process)."""
        self.servicer.serving.set()
        for service in ("", SERVICE):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)

    def stop(self) -> None:
        self.server.stop(grace=None).wait()
