"""The client's value types, its error type, and the wire <-> value conversions.

Shared by ``Client`` (blocking) and ``AsyncClient`` (grpc.aio). Imports grpc
and the generated messages, never jax.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from jaxserve.proto import generate_pb2 as pb
from jaxserve.proto.convert import finish_reason_from_proto, sampling_params_to_proto
from jaxserve.sampling_params import SamplingParams

# A chat message: {"role": ..., "content": ...} (OpenAI's shape, tool_calls and tool_call_id
# included), a (role, content) pair, or the proto message.
Message = Mapping[str, Any] | tuple[str, str] | pb.ChatMessage

# tool_choice: "none" / "auto" / "required", a function's name, or OpenAI's
# {"type": "function", "function": {"name": ...}} (or {"name": ...}).
ToolChoice = str | Mapping[str, Any]

DEFAULT_PORT = 50051  # where ``jaxserve serve`` listens unless told otherwise

# The health-service name whose SERVING means "Generate answers": jaxserve.GenerateService.
GENERATE_SERVICE = pb.DESCRIPTOR.services_by_name["GenerateService"].full_name
# Health-check failures that mean "not ready yet" while waiting: nothing listening
# or a connection lost (UNAVAILABLE), a slow answer (DEADLINE_EXCEEDED), the
# service not registered yet (NOT_FOUND).
NOT_READY_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                             grpc.StatusCode.NOT_FOUND})
READY_POLL_S = 0.1  # seconds between health checks while waiting for SERVING


class JaxServeError(Exception):
    """A call failed; carries the gRPC status code and the server's message.

    Attributes:
      code: ``grpc.StatusCode`` (``INVALID_ARGUMENT``, ``RESOURCE_EXHAUSTED``,
        ``DEADLINE_EXCEEDED``, ``UNAVAILABLE``, ...).
      message: the status details; for ``INVALID_ARGUMENT`` it starts with the
        field's name.
    """

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_rpc_error(cls, err: grpc.RpcError) -> "JaxServeError":
        """From a ``grpc.RpcError`` (sync) or ``grpc.aio.AioRpcError``."""
        code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
        details = err.details() if callable(getattr(err, "details", None)) else str(err)
        return cls(code or grpc.StatusCode.UNKNOWN, details or "")


def with_default_port(target: str) -> str:
    """``target`` with ``:DEFAULT_PORT`` appended when it names a host without a port.

    gRPC would otherwise dial port 443 for ``"localhost"``. Targets with a
    scheme (``dns:``, ``unix:``, ``ipv4:``...) and bare IPv6 addresses are
    returned unchanged; ``"[::1]"`` becomes ``"[::1]:50051"``.
    """
    if "://" in target or target.startswith(("dns:", "unix:", "unix-abstract:", "ipv4:",
                                              "ipv6:", "vsock:")):
        return target
    if target.startswith("["):
        return target if "]:" in target else f"{target}:{DEFAULT_PORT}"
    if target.count(":") == 0:
        return f"{target}:{DEFAULT_PORT}"
    return target


class ReadyWait:
    """The bookkeeping of ``wait_ready`` (shared by ``Client`` and ``AsyncClient``).

    Each round: ``remaining()`` (raises once the time is up), one health
    ``Check`` of ``request``, then ``serving(reply)`` or ``failed(err)``, then
    a pause of ``pause_s()`` seconds.

    Args:
      target: the server's address (named in the error).
      timeout: seconds in all; None = no limit.
    """

    request = health_pb2.HealthCheckRequest(service=GENERATE_SERVICE)

    def __init__(self, target: str, timeout: float | None) -> None:
        self.target = target
        self.timeout = timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.last = "no answer"

    def remaining(self) -> float | None:
        """Seconds left (None = no limit).

        Raises:
          JaxServeError: (``UNAVAILABLE``) the time is up; names the last status or error.
        """
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise JaxServeError(
                grpc.StatusCode.UNAVAILABLE,
                f"the server at {self.target} did not report SERVING for {GENERATE_SERVICE} "
                f"within {self.timeout} s (last: {self.last}); is it running? Start one with "
                f"`jaxserve serve --model MODEL_DIR`")
        return left

    def serving(self, reply: health_pb2.HealthCheckResponse) -> bool:
        """True when ``reply`` says SERVING."""
        if reply.status == health_pb2.HealthCheckResponse.SERVING:
            return True
        self.last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return False

    def failed(self, err: grpc.RpcError) -> None:
        """Notes a not-ready failure; raises ``JaxServeError`` for others (``UNIMPLEMENTED``)."""
        if err.code() not in NOT_READY_CODES:
            raise JaxServeError.from_rpc_error(err) from None
        self.last = f"{err.code().name}: {err.details()}"

    def pause_s(self) -> float:
        """Seconds to wait before the next check."""
        left = None if self.deadline is None else self.deadline - time.monotonic()
        return READY_POLL_S if left is None else max(0.0, min(READY_POLL_S, left))


@dataclasses.dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Logprobs (natural log) of one token: the sampled (or prompt) one, the top N, and
    its rank (1 = most likely)."""

    logprob: float
    top_token_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]
    rank: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCall:
    """A function call the model made (OpenAI's ``message.tool_calls`` entry):
    ``arguments`` is JSON text of an object; ``id`` is fresh per call."""

    id: str
    name: str
    arguments: str


@dataclasses.dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one completion (prompt counts are the request's)."""

    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclasses.dataclass(frozen=True, slots=True)
class StreamDelta:
    """One streamed response: what is new in completion ``index``.

    ``finish_reason`` ("stop" / "length" / "abort"), ``stop_reason`` (the stop
    string, the stop token id, or None for EOS) and ``usage`` are set on the
    completion's last delta only. ``prompt_logprobs`` (with the
    ``prompt_logprobs`` parameter, in a completion's first delta): one per
    prompt token from the second, its logprob given the tokens before it.
    ``tool_calls`` (a chat with tools and a ``tool_choice`` other than
    ``"none"``, on the last delta): the calls read out of the completion's
    whole text; ``finish_reason`` is then ``"tool_calls"`` if it stopped.
    """

    request_id: str
    index: int
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprobs, ...]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    usage: Usage | None = None
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()

    @property
    def finished(self) -> bool:
        """True on the completion's last delta."""
        return self.usage is not None


@dataclasses.dataclass(frozen=True, slots=True)
class Completion:
    """One finished completion (of ``n``); ``prompt_logprobs`` and ``tool_calls`` as
    ``StreamDelta``'s."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...]
    finish_reason: str | None
    stop_reason: str | int | None
    usage: Usage
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class GenerateResult:
    """A finished request: its completions ordered by index.

    ``text``, ``token_ids``, ``finish_reason``, ``stop_reason``, ``usage`` and
    ``tool_calls`` are those of completion 0 (the only one when n == 1).
    """

    request_id: str
    completions: tuple[Completion, ...]

    @property
    def text(self) -> str:
        return self.completions[0].text

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.completions[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.completions[0].finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        return self.completions[0].stop_reason

    @property
    def usage(self) -> Usage:
        return self.completions[0].usage

    @property
    def tool_calls(self) -> tuple[ToolCall, ...]:
        return self.completions[0].tool_calls


@dataclasses.dataclass(frozen=True, slots=True)
class ModelInfo:
    """``GetModelInfo``: the served model and KV-cache occupancy (lengths in tokens);
    ``quantization`` is the weights' method ("int8"), "" when unquantized;
    ``kv_cache_dtype`` the server's ``--kv-cache-dtype`` (vLLM's values: "auto", the
    model's dtype; "fp8" or "fp8_e4m3", e4m3 keys and values)."""

    model: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks_free: int
    num_kv_blocks_total: int
    eos_token_ids: tuple[int, ...]
    quantization: str = ""
    kv_cache_dtype: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class TokenizeResult:
    """``Tokenize``: the ids, and the text they came from (a chat rendered by its template)."""

    token_ids: tuple[int, ...]
    text: str


def _chat(messages: Iterable[Message], add_generation_prompt: bool | None,
          tools: Iterable[Mapping[str, Any]] | None = None,
          tool_choice: ToolChoice | None = None,
          parallel_tool_calls: bool | None = None) -> pb.Chat:
    """A ``pb.Chat``: messages in OpenAI's shape (an assistant's ``tool_calls`` with
    ``arguments`` as JSON text or an object, a tool's ``tool_call_id``), ``tools``
    as ``{"type": "function", "function": {"name", "description", "parameters"}}``,
    ``tool_choice`` (``ToolChoice``) and ``parallel_tool_calls``."""
    chat = pb.Chat()
    for message in messages:
        if isinstance(message, pb.ChatMessage):
            chat.messages.append(message)
        elif isinstance(message, Mapping):
            calls = [pb.ToolCall(id=c.get("id", ""), name=c["function"]["name"],
                                 arguments=_json_text(c["function"].get("arguments", {})))
                     for c in message.get("tool_calls") or ()]
            chat.messages.add(role=message["role"], content=message.get("content") or "",
                              tool_calls=calls, tool_call_id=message.get("tool_call_id") or "")
        else:
            role, content = message
            chat.messages.add(role=role, content=content)
    for tool in tools or ():
        function = tool["function"]
        parameters = function.get("parameters")
        chat.tools.add(name=function["name"], description=function.get("description") or "",
                       parameters="" if parameters is None else _json_text(parameters))
    if isinstance(tool_choice, Mapping):
        function = tool_choice.get("function", tool_choice)
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str):
            raise TypeError(f"tool_choice names a function as {{'type': 'function', "
                            f"'function': {{'name': ...}}}} or {{'name': ...}}, got "
                            f"{dict(tool_choice)!r:.80}")
        chat.tool_choice_function = name
    elif tool_choice in ("none", "auto", "required"):
        chat.tool_choice_mode = tool_choice
    elif isinstance(tool_choice, str):
        chat.tool_choice_function = tool_choice
    elif tool_choice is not None:
        raise TypeError(f"tool_choice must be a string or a mapping, got "
                        f"{type(tool_choice).__name__}")
    if parallel_tool_calls is not None:
        chat.parallel_tool_calls = parallel_tool_calls
    if add_generation_prompt is not None:
        chat.add_generation_prompt = add_generation_prompt
    return chat


def _json_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def build_generate_request(prompt: str | Sequence[int] | None, *,
                           messages: Iterable[Message] | None,
                           sampling_params: SamplingParams | Mapping[str, Any] | None,
                           params: Mapping[str, Any], stream: bool, request_id: str = "",
                           cache_salt: str = "",
                           add_generation_prompt: bool | None = None,
                           tools: Iterable[Mapping[str, Any]] | None = None,
                           tool_choice: ToolChoice | None = None,
                           parallel_tool_calls: bool | None = None) -> pb.GenerateRequest:
    """The ``GenerateRequest`` for one call; values are checked by the server, not here.

    ``params`` (keyword sampling parameters) override ``sampling_params``.

    Raises:
      ValueError: both or neither of ``prompt`` / ``messages``; tools or a tool
        choice without ``messages``; an unknown sampling parameter or one the
        wire type cannot hold.
    """
    if (prompt is None) == (messages is None):
        raise ValueError("pass exactly one of prompt (text or token ids) and messages")
    if messages is None and (tools or tool_choice is not None
                             or parallel_tool_calls is not None):
        raise ValueError("tools, tool_choice and parallel_tool_calls need messages (a chat)")
    if isinstance(sampling_params, SamplingParams):
        values = sampling_params.to_dict()
    else:
        values = dict(sampling_params or {})
    values.update(params)
    request = pb.GenerateRequest(request_id=request_id, stream=stream, cache_salt=cache_salt,
                                 sampling_params=sampling_params_to_proto(values))
    if messages is not None:
        request.chat.CopyFrom(_chat(messages, add_generation_prompt, tools, tool_choice,
                                    parallel_tool_calls))
    elif isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.SetInParent()  # an empty list is still "token ids were given"
        request.token_ids.ids.extend(int(i) for i in prompt)
    return request


def build_tokenize_request(text: str | None, messages: Iterable[Message] | None,
                           add_generation_prompt: bool | None,
                           tools: Iterable[Mapping[str, Any]] | None = None) -> pb.TokenizeRequest:
    """The ``TokenizeRequest``. Raises ``ValueError`` unless exactly one input is given."""
    if (text is None) == (messages is None):
        raise ValueError("pass exactly one of text and messages")
    if messages is not None:
        return pb.TokenizeRequest(chat=_chat(messages, add_generation_prompt, tools))
    return pb.TokenizeRequest(text=text)


def delta_from_proto(response: pb.GenerateResponse) -> StreamDelta:
    """A ``StreamDelta`` from one ``GenerateResponse``."""
    def convert(entries) -> tuple[TokenLogprobs, ...]:
        return tuple(TokenLogprobs(lp.logprob, tuple(lp.top_token_ids), tuple(lp.top_logprobs),
                                   lp.rank) for lp in entries)

    delta = StreamDelta(response.request_id, response.index, tuple(response.token_ids),
                        response.text, convert(response.logprobs),
                        prompt_logprobs=convert(response.prompt_logprobs),
                        tool_calls=tuple(ToolCall(c.id, c.name, c.arguments)
                                         for c in response.tool_calls))
    if not response.HasField("finished"):
        return delta
    fin = response.finished
    matched = fin.WhichOneof("matched")
    return dataclasses.replace(
        delta, finish_reason=finish_reason_from_proto(fin.reason),
        stop_reason=None if matched is None else getattr(fin, matched),
        usage=Usage(fin.prompt_tokens, fin.completion_tokens, fin.cached_prompt_tokens))


def model_info_from_proto(response: pb.GetModelInfoResponse) -> ModelInfo:
    return ModelInfo(response.model, response.max_model_len, response.vocab_size,
                     response.block_size, response.num_kv_blocks_free,
                     response.num_kv_blocks_total, tuple(response.eos_token_ids),
                     response.quantization, response.kv_cache_dtype)


class ResultBuilder:
    """Accumulates the deltas of one request into a ``GenerateResult``.

    Args:
      num_completions: n, the completions the request asked for.
    """

    def __init__(self, num_completions: int) -> None:
        self._n = num_completions
        self._request_id = ""
        self._parts: dict[int, list[StreamDelta]] = {}

    def add(self, delta: StreamDelta) -> None:
        self._request_id = self._request_id or delta.request_id
        self._parts.setdefault(delta.index, []).append(delta)

    def result(self) -> GenerateResult:
        """The finished result.

        Raises:
          JaxServeError: (``INTERNAL``) the stream ended before every completion finished.
        """
        completions = []
        for index in range(self._n):
            parts = self._parts.get(index, [])
            if not parts or not parts[-1].finished:
                raise JaxServeError(grpc.StatusCode.INTERNAL,
                                    f"the response stream ended before completion {index} finished")
            last = parts[-1]
            assert last.usage is not None
            completions.append(Completion(
                index=index, text="".join(p.text for p in parts),
                token_ids=tuple(t for p in parts for t in p.token_ids),
                logprobs=tuple(lp for p in parts for lp in p.logprobs),
                finish_reason=last.finish_reason, stop_reason=last.stop_reason, usage=last.usage,
                prompt_logprobs=tuple(lp for p in parts for lp in p.prompt_logprobs),
                tool_calls=last.tool_calls))
        return GenerateResult(self._request_id, tuple(completions))


def num_completions(request: pb.GenerateRequest) -> int:
    """n of a request (1 when absent)."""
    params = request.sampling_params
    return params.n if params.HasField("n") else 1


def call_metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    """The metadata every call sends: ``authorization: Bearer <key>``, or None without a key."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


def channel_credentials(tls: bool, root_certificates: bytes | None
                        ) -> grpc.ChannelCredentials | None:
    """TLS credentials (the system's roots, or ``root_certificates`` PEM), or None for none."""
    if not tls and root_certificates is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=root_certificates)
