"""``AsyncClient``: the asyncio (``grpc.aio``) Python client of the jaxserve gRPC service.

The same methods and semantics as ``jaxserve.client.Client``, as coroutines;
``stream`` is an async iterator. Create and use it inside a running event
loop (``grpc.aio`` channels belong to the loop they were created in).
Closing a stream early (``aclose()``, or leaving ``async for`` and letting
the generator be finalized) cancels the call.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxserve.client.sync import DEFAULT_TARGET
from jaxserve.client.types import (GenerateResult, JaxServeError, Message, ModelInfo,
                                   ReadyWait, ResultBuilder, StreamDelta, TokenizeResult,
                                   ToolChoice,
                                   build_generate_request, build_tokenize_request,
                                   call_metadata, channel_credentials, delta_from_proto,
                                   model_info_from_proto, num_completions, with_default_port)
from jaxserve.proto import generate_pb2 as pb
from jaxserve.proto import generate_pb2_grpc as pb_grpc
from jaxserve.sampling_params import SamplingParams


class AsyncClient:
    """Asyncio client; see ``jaxserve.client.Client`` for the arguments and semantics."""

    def __init__(self, target: str = DEFAULT_TARGET, *, timeout: float | None = None,
                 channel: grpc.aio.Channel | None = None,
                 options: Sequence[tuple[str, Any]] | None = None, api_key: str | None = None,
                 tls: bool = False, root_certificates: bytes | None = None) -> None:
        self._owns_channel = channel is None
        self.target = with_default_port(target)
        if channel is None:
            credentials = channel_credentials(tls, root_certificates)
            channel = (grpc.aio.insecure_channel(self.target, options=options)
                       if credentials is None
                       else grpc.aio.secure_channel(self.target, credentials, options=options))
        self._channel = channel
        self._metadata = call_metadata(api_key)
        self._stub = pb_grpc.GenerateServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._timeout = timeout

    async def close(self) -> None:
        """Closes the channel (when the client created it)."""
        if self._owns_channel:
            await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _deadline(self, timeout: float | None) -> float | None:
        return self._timeout if timeout is None else timeout

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Waits until health reports SERVING for GenerateService; see ``Client.wait_ready``.

        Raises:
          JaxServeError: (``UNAVAILABLE``) not SERVING within ``timeout`` seconds;
            any other health-check failure.
        """
        wait = ReadyWait(self.target, self._deadline(timeout))
        while True:
            remaining = wait.remaining()
            try:
                reply = await self._health.Check(wait.request, timeout=remaining,
                                                 wait_for_ready=True)
                if wait.serving(reply):
                    return
            except grpc.aio.AioRpcError as err:
                wait.failed(err)
            await asyncio.sleep(wait.pause_s())

    async def generate(self, prompt: str | Sequence[int] | None = None, *,
                       messages: Iterable[Message] | None = None,
                       sampling_params: SamplingParams | Mapping[str, Any] | None = None,
                       request_id: str = "", cache_salt: str = "",
                       add_generation_prompt: bool | None = None,
                       tools: Iterable[Mapping[str, Any]] | None = None,
                       tool_choice: ToolChoice | None = None,
                       parallel_tool_calls: bool | None = None,
                       timeout: float | None = None, **params: Any) -> GenerateResult:
        """Generates and returns the finished completion(s); see ``Client.generate``."""
        request = build_generate_request(
            prompt, messages=messages, sampling_params=sampling_params, params=params,
            stream=False, request_id=request_id, cache_salt=cache_salt,
            add_generation_prompt=add_generation_prompt, tools=tools,
            tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls)
        builder = ResultBuilder(num_completions(request))
        async for delta in self._call_stream(request, timeout):
            builder.add(delta)
        return builder.result()

    async def chat(self, messages: Iterable[Message], **kwargs: Any) -> GenerateResult:
        """``generate(messages=messages, **kwargs)``."""
        return await self.generate(messages=messages, **kwargs)

    def stream(self, prompt: str | Sequence[int] | None = None, *,
               messages: Iterable[Message] | None = None,
               sampling_params: SamplingParams | Mapping[str, Any] | None = None,
               request_id: str = "", cache_salt: str = "",
               add_generation_prompt: bool | None = None,
               tools: Iterable[Mapping[str, Any]] | None = None,
               tool_choice: ToolChoice | None = None,
               parallel_tool_calls: bool | None = None,
               timeout: float | None = None, **params: Any) -> AsyncIterator[StreamDelta]:
        """An async iterator of ``StreamDelta``s; see ``Client.stream``.

        Not a coroutine: ``async for delta in client.stream(...)``.
        """
        request = build_generate_request(
            prompt, messages=messages, sampling_params=sampling_params, params=params,
            stream=True, request_id=request_id, cache_salt=cache_salt,
            add_generation_prompt=add_generation_prompt, tools=tools,
            tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls)
        return self._call_stream(request, timeout)

    async def _call_stream(self, request: pb.GenerateRequest,
                           timeout: float | None) -> AsyncIterator[StreamDelta]:
        call = self._stub.Generate(request, timeout=self._deadline(timeout),
                                  metadata=self._metadata)
        try:
            async for response in call:
                yield delta_from_proto(response)
        except grpc.aio.AioRpcError as err:
            raise JaxServeError.from_rpc_error(err) from None
        finally:
            call.cancel()  # no-op once the call has finished

    async def tokenize(self, text: str | None = None, *,
                       messages: Iterable[Message] | None = None,
                       add_generation_prompt: bool | None = None,
                       tools: Iterable[Mapping[str, Any]] | None = None,
                       timeout: float | None = None) -> TokenizeResult:
        """See ``Client.tokenize``."""
        request = build_tokenize_request(text, messages, add_generation_prompt, tools)
        response = await self._unary(self._stub.Tokenize, request, timeout)
        return TokenizeResult(tuple(response.token_ids), response.text)

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        """See ``Client.model_info``."""
        return model_info_from_proto(
            await self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout))

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """See ``Client.health``."""
        response = await self._unary(self._health.Check,
                                     health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    async def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        try:
            return await method(request, timeout=self._deadline(timeout),
                                metadata=self._metadata)
        except grpc.aio.AioRpcError as err:
            raise JaxServeError.from_rpc_error(err) from None
