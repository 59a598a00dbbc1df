"""``Client``: the blocking Python client of the jaxserve gRPC service.

Every call takes ``timeout`` (seconds; None = the client's default, which may
be None = no deadline) and raises ``JaxServeError`` carrying the gRPC status
and the server's message. For ``stream`` the deadline covers the whole stream.
Closing a stream iterator early (``close()``, or dropping it after ``break``)
cancels the call, which aborts the request on the server.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve.client.types import (DEFAULT_PORT, GenerateResult, JaxServeError, Message,
                                   ModelInfo, ResultBuilder, StreamDelta, TokenizeResult,
                                   ToolChoice,
                                   build_generate_request, build_tokenize_request,
                                   call_metadata, channel_credentials, delta_from_proto,
                                   model_info_from_proto, num_completions, ReadyWait,
                                   with_default_port)
from jaxserve.proto import generate_pb2 as pb
from jaxserve.proto import generate_pb2_grpc as pb_grpc
from jaxserve.sampling_params import SamplingParams

DEFAULT_TARGET = f"localhost:{DEFAULT_PORT}"


class Client:
    """Blocking client: generate, stream, chat, tokenize, model_info, health.

    Args:
      target: ``host:port`` of the server; a bare host gets the default port
        (50051), as ``jaxserve serve`` listens there.
      timeout: default deadline of every call, in seconds (None = none).
      channel: use this channel instead of creating one to ``target``
        (interceptors, custom credentials); the client then does not close it.
      options: gRPC channel options for the channel it creates.
      api_key: sent as metadata ``authorization: Bearer <key>`` with every
        call (a server started with ``--api-key`` refuses calls without it,
        ``UNAUTHENTICATED``).
      tls: connect with TLS, trusting the system's root certificates or
        ``root_certificates``.
      root_certificates: PEM bytes of the certificates to trust (e.g. a
        server's self-signed certificate); implies ``tls``.

    Sampling parameters are keyword arguments (``temperature=0,
    max_tokens=32``) and/or ``sampling_params=`` a ``SamplingParams`` or a
    dict; keywords win. They are validated by the server (``INVALID_ARGUMENT``);
    unset ones take the server's defaults (``SamplingParams``' defaults, except
    ``max_tokens``: up to the context length).

    Chats may pass ``tools`` (OpenAI's ``{"type": "function", "function":
    {"name", "description", "parameters"}}``), ``tool_choice`` (``"none"``,
    ``"auto"``, ``"required"``, or a function as ``{"type": "function",
    "function": {"name": ...}}`` or its bare name) and ``parallel_tool_calls``;
    the calls come back in ``Completion.tool_calls`` / the last
    ``StreamDelta.tool_calls`` with finish reason ``"tool_calls"``
    (left out: ``"auto"`` with tools, which needs a server started with
    ``--enable-auto-tool-choice``).
    """

    def __init__(self, target: str = DEFAULT_TARGET, *, timeout: float | None = None,
                 channel: grpc.Channel | None = None,
                 options: Sequence[tuple[str, Any]] | None = None, api_key: str | None = None,
                 tls: bool = False, root_certificates: bytes | None = None) -> None:
        self._owns_channel = channel is None
        self.target = with_default_port(target)
        if channel is None:
            credentials = channel_credentials(tls, root_certificates)
            channel = (grpc.insecure_channel(self.target, options=options) if credentials is None
                       else grpc.secure_channel(self.target, credentials, options=options))
        self._channel = channel
        self._metadata = call_metadata(api_key)
        self._stub = pb_grpc.GenerateServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._timeout = timeout

    def close(self) -> None:
        """Closes the channel (when the client created it)."""
        if self._owns_channel:
            self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _deadline(self, timeout: float | None) -> float | None:
        return self._timeout if timeout is None else timeout

    def wait_ready(self, timeout: float | None = None) -> None:
        """Blocks until the health service reports SERVING for ``jaxserve.GenerateService``.

        A server answers health checks while it starts (NOT_SERVING; Generate
        then fails with ``UNAVAILABLE``); this polls ``grpc.health.v1`` Check
        every 0.1 s, waiting for the connection too, until the status is
        SERVING. A request sent after it returns is served.

        Args:
          timeout: seconds to wait in all (None = the client's default; None
            there too = no limit).

        Raises:
          JaxServeError: (``UNAVAILABLE``) not SERVING within ``timeout``
            seconds (the message names the last status or error); any other
            health-check failure (e.g. ``UNIMPLEMENTED``: no health service).
        """
        wait = ReadyWait(self.target, self._deadline(timeout))
        while True:
            remaining = wait.remaining()
            try:
                reply = self._health.Check(wait.request, timeout=remaining, wait_for_ready=True)
                if wait.serving(reply):
                    return
            except grpc.RpcError as err:
                wait.failed(err)
            time.sleep(wait.pause_s())

    def generate(self, prompt: str | Sequence[int] | None = None, *,
                 messages: Iterable[Message] | None = None,
                 sampling_params: SamplingParams | Mapping[str, Any] | None = None,
                 request_id: str = "", cache_salt: str = "",
                 add_generation_prompt: bool | None = None,
                 tools: Iterable[Mapping[str, Any]] | None = None,
                 tool_choice: ToolChoice | None = None,
                 parallel_tool_calls: bool | None = None,
                 timeout: float | None = None, **params: Any) -> GenerateResult:
        """Generates and returns the finished completion(s).

        Args:
          prompt: text, or token ids; or pass ``messages`` (a chat) instead.
          messages: chat messages (dicts with role / content, or pairs).
          sampling_params, **params: see the class docstring.
          request_id: "" lets the server choose one.
          cache_salt: separates prefix-cache entries ("" = shared).
          add_generation_prompt: chat only; None = the server default (True).
          timeout: seconds for the whole call.

        Raises:
          JaxServeError: the call failed (status code + server message).
          ValueError: both or neither of prompt / messages; an unknown
            sampling parameter (checked before sending).
        """
        request = build_generate_request(
            prompt, messages=messages, sampling_params=sampling_params, params=params,
            stream=False, request_id=request_id, cache_salt=cache_salt,
            add_generation_prompt=add_generation_prompt, tools=tools,
            tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls)
        builder = ResultBuilder(num_completions(request))
        for delta in self._call_stream(request, timeout):
            builder.add(delta)
        return builder.result()

    def chat(self, messages: Iterable[Message], **kwargs: Any) -> GenerateResult:
        """``generate(messages=messages, **kwargs)``."""
        return self.generate(messages=messages, **kwargs)

    def stream(self, prompt: str | Sequence[int] | None = None, *,
               messages: Iterable[Message] | None = None,
               sampling_params: SamplingParams | Mapping[str, Any] | None = None,
               request_id: str = "", cache_salt: str = "",
               add_generation_prompt: bool | None = None,
               tools: Iterable[Mapping[str, Any]] | None = None,
               tool_choice: ToolChoice | None = None,
               parallel_tool_calls: bool | None = None,
               timeout: float | None = None, **params: Any) -> Iterator[StreamDelta]:
        """Generates, yielding ``StreamDelta``s as the server produces them.

        Arguments as ``generate``. With n > 1 the deltas of the completions
        interleave (``delta.index``). The request is built (and ``ValueError``
        raised) right away; the call starts on the first ``next``.

        Raises (while iterating):
          JaxServeError: the call failed.
        """
        request = build_generate_request(
            prompt, messages=messages, sampling_params=sampling_params, params=params,
            stream=True, request_id=request_id, cache_salt=cache_salt,
            add_generation_prompt=add_generation_prompt, tools=tools,
            tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls)
        return self._call_stream(request, timeout)

    def _call_stream(self, request: pb.GenerateRequest,
                     timeout: float | None) -> Iterator[StreamDelta]:
        call = self._stub.Generate(request, timeout=self._deadline(timeout),
                                  metadata=self._metadata)
        try:
            for response in call:
                yield delta_from_proto(response)
        except grpc.RpcError as err:
            raise JaxServeError.from_rpc_error(err) from None
        finally:
            call.cancel()  # no-op once the call has finished

    def tokenize(self, text: str | None = None, *, messages: Iterable[Message] | None = None,
                 add_generation_prompt: bool | None = None,
                 tools: Iterable[Mapping[str, Any]] | None = None,
                 timeout: float | None = None) -> TokenizeResult:
        """The token ids the server would generate from for ``text`` or a chat.

        Raises:
          JaxServeError: the call failed.
          ValueError: both or neither of text / messages.
        """
        request = build_tokenize_request(text, messages, add_generation_prompt, tools)
        response = self._unary(self._stub.Tokenize, request, timeout)
        return TokenizeResult(tuple(response.token_ids), response.text)

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        """The served model and its KV-cache occupancy.

        Raises:
          JaxServeError: the call failed.
        """
        return model_info_from_proto(
            self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout))

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The ``grpc.health.v1`` status of ``service`` ("" = the whole server): ``"SERVING"``, ...

        Raises:
          JaxServeError: the call failed (``NOT_FOUND`` for an unknown service).
        """
        response = self._unary(self._health.Check,
                               health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        try:
            return method(request, timeout=self._deadline(timeout), metadata=self._metadata)
        except grpc.RpcError as err:
            raise JaxServeError.from_rpc_error(err) from None
