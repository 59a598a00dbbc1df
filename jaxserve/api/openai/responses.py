"""OpenAI responses: a call's ``OpenAIResult`` (a JSON body or SSE chunks) and error objects (jax-free).

``OpenAIServing`` (``jaxserve.api.openai.serving``) starts a call's engine
requests and returns an ``OpenAIResult``; the HTTP app renders it whole
(``body()``) or streamed (``events()``, ending with ``data: [DONE]``). An
``ApiError`` becomes OpenAI's error object (``error_body``) with the HTTP
status of its gRPC code (``http_status``), in a response or, mid-stream, as
one last event.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from jaxserve.api.prompts import PreparedRequest
from jaxserve.api.runner import ApiError, RunningRequest
from jaxserve.api.tool_calling import NO_TOOLS, ToolCallPlan
from jaxserve.api.tool_parsers import new_tool_call_id
from jaxserve.proto import generate_pb2 as pb
from jaxserve.proto.convert import finish_reason_from_proto

if TYPE_CHECKING:
    from jaxserve.api.openai.serving import OpenAIServing

_DONE = object()


class OpenAIResult:
    """The running request(s) of one OpenAI call: render as JSON or as SSE chunks.

    Args:
      serving: the ``OpenAIServing`` (tokenizer, logprob rendering).
      kind: ``"text_completion"`` or ``"chat.completion"``.
      request_id: the response ``id``.
      running: one ``RunningRequest`` per prompt (each with ``n`` choices).
      prepared: their ``PreparedRequest``s (prompt lengths, ``n``).
      echo: per prompt, text to prepend to each choice (completions ``echo``), or None.
      include_usage: streamed: end with a chunk carrying ``usage``.
      as_ids: logprob tokens as ``"token_id:<id>"``.
      continuous_usage: streamed: every chunk carries the usage so far (vLLM's
        ``stream_options.continuous_usage_stats``).
      tools: chat: how replies are read for tool calls (``message.tool_calls``,
        ``delta.tool_calls``; finish reason ``tool_calls`` for a reply that
        made calls and stopped on its own).
    """

    def __init__(self, serving: OpenAIServing, kind: str, request_id: str,
                 running: list[RunningRequest], prepared: list[PreparedRequest], *,
                 echo: list[str] | None, include_usage: bool, as_ids: bool,
                 continuous_usage: bool = False, tools: ToolCallPlan = NO_TOOLS) -> None:
        self.serving = serving
        self.kind = kind
        self.id = request_id
        self.running = running
        self.n = prepared[0].params.n
        self.want_logprobs = prepared[0].params.logprobs is not None
        self.want_prompt_logprobs = prepared[0].params.prompt_logprobs is not None
        self._prompt_ids = [p.prompt_token_ids for p in prepared]
        self.echo = echo
        self.include_usage = include_usage
        self.as_ids = as_ids
        self.created = int(time.time())
        self.model = serving.runner.model_name
        self._prompt_tokens = [len(p.prompt_token_ids) for p in prepared]
        self._cached = [0] * len(prepared)
        self._completion_tokens: dict[int, int] = {}  # choice index -> tokens sent so far
        self.continuous_usage = continuous_usage
        self.tools = tools

    def close(self) -> None:
        """Aborts every request that has not finished (idempotent)."""
        for running in self.running:
            running.close()

    async def _responses(self) -> AsyncIterator[tuple[int, pb.GenerateResponse]]:
        """(choice index, response) from every prompt's request, as they come."""
        if len(self.running) == 1:
            async for response in self.running[0].responses():
                yield response.index, response
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(prompt_index: int, running: RunningRequest) -> None:
            try:
                async for response in running.responses():
                    queue.put_nowait((prompt_index * self.n + response.index, response))
            except ApiError as err:
                queue.put_nowait(err)
            finally:
                queue.put_nowait(_DONE)

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(self.running)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is _DONE:
                    remaining -= 1
                elif isinstance(item, ApiError):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            self.close()

    def _account(self, index: int, response: pb.GenerateResponse) -> None:
        self._completion_tokens[index] = (self._completion_tokens.get(index, 0)
                                          + len(response.token_ids))
        if response.HasField("finished"):
            self._cached[index // self.n] = response.finished.cached_prompt_tokens

    def usage(self) -> dict[str, Any]:
        """OpenAI ``usage`` (with ``prompt_tokens_details.cached_tokens``)."""
        prompt = sum(self._prompt_tokens)
        completion = sum(self._completion_tokens.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self._cached)}}

    @staticmethod
    def _finish(response: pb.GenerateResponse) -> tuple[str | None, str | int | None]:
        if not response.HasField("finished"):
            return None, None
        finished = response.finished
        matched = finished.WhichOneof("matched")
        return (finish_reason_from_proto(finished.reason),
                getattr(finished, matched) if matched else None)

    # --------------------------------------------------------------- whole
    async def body(self) -> dict[str, Any]:
        """The whole response object (non-streamed requests).

        Raises:
          ApiError: the engine failed (``UNAVAILABLE``).
        """
        choices: dict[int, dict[str, Any]] = {}
        prompt_logprobs = None  # chat: the response's, from choice 0
        async for index, response in self._responses():
            self._account(index, response)
            reason, stop_reason = self._finish(response)
            text = response.text
            prompt_ids = self._prompt_ids[index // self.n]
            if self.kind == "text_completion":
                echo = self.echo[index // self.n] if self.echo else ""
                choice = {"index": index, "text": echo + text, "logprobs": None,
                          "finish_reason": reason, "stop_reason": stop_reason}
                if self.want_logprobs:
                    choice["logprobs"] = self._with_echo(
                        prompt_ids, response,
                        self.serving.completion_logprobs(response, len(echo), self.as_ids))
                if self.want_prompt_logprobs:
                    choice["prompt_logprobs"] = self.serving.prompt_logprobs(prompt_ids, response)
            else:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if self.tools.parses:
                    content, calls = self.tools.extract(text)
                    if calls:
                        message = {"role": "assistant", "content": content, "tool_calls": [
                            call.to_openai(new_tool_call_id()) for call in calls]}
                        reason = "tool_calls" if reason == "stop" else reason
                choice = {"index": index, "message": message, "logprobs": None,
                          "finish_reason": reason, "stop_reason": stop_reason}
                if self.want_logprobs:
                    choice["logprobs"] = self.serving.chat_logprobs(response, self.as_ids)
                if self.want_prompt_logprobs and index == 0:
                    prompt_logprobs = self.serving.prompt_logprobs(prompt_ids, response)
            choices[index] = choice
        body = {"id": self.id, "object": self.kind, "created": self.created, "model": self.model,
                "choices": [choices[i] for i in sorted(choices)], "usage": self.usage()}
        if self.kind == "chat.completion" and self.want_prompt_logprobs:
            body["prompt_logprobs"] = prompt_logprobs
        return body

    def _with_echo(self, prompt_ids: Sequence[int], response: pb.GenerateResponse,
                   logprobs: dict[str, Any]) -> dict[str, Any]:
        """A choice's completions ``logprobs`` with the echoed prompt's first (in the
        response carrying the prompt logprobs: the choice's first), else as they are."""
        if not self.echo or not (response.prompt_logprobs or len(prompt_ids) == 1):
            return logprobs
        prompt = self.serving.echo_logprobs(prompt_ids, response, self.as_ids)
        return {key: prompt[key] + logprobs[key] for key in logprobs}

    # ------------------------------------------------------------- stream
    async def events(self) -> AsyncIterator[str]:
        """Server-Sent Events: ``data: <chunk>`` lines, then ``data: [DONE]``.

        An engine failure mid-stream is sent as ``data: {"error": ...}``
        before ``[DONE]``.
        """
        chunk_kind = self.kind + ".chunk" if self.kind == "chat.completion" else self.kind
        offsets: dict[int, int] = {}
        tool_streams: dict[int, Any] = {}  # chat: choice index -> its ToolCallStream or None
        try:
            async for index, response in self._responses():
                self._account(index, response)
                reason, stop_reason = self._finish(response)
                first = index not in offsets
                if first:
                    offsets[index] = 0
                text = response.text
                if self.kind == "text_completion":
                    if first and self.echo:
                        text = self.echo[index // self.n] + text
                    if not text and reason is None and not (self.want_logprobs
                                                            and response.token_ids):
                        continue
                    choice = {"index": index, "text": text, "logprobs": None,
                              "finish_reason": reason, "stop_reason": stop_reason}
                    if self.want_logprobs:
                        choice["logprobs"] = self.serving.completion_logprobs(
                            response, offsets[index] + len(text) - len(response.text),
                            self.as_ids)
                        if first:
                            choice["logprobs"] = self._with_echo(
                                self._prompt_ids[index // self.n], response, choice["logprobs"])
                    offsets[index] += len(text)
                else:
                    if first:
                        tool_streams[index] = self.tools.stream()
                        yield self._chunk(chunk_kind, [{
                            "index": index, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None}])
                    stream = tool_streams[index]
                    if stream is None:
                        deltas = [{"content": text}] if text else []
                    else:
                        deltas = stream.push(text, final=reason is not None)
                        reason = "tool_calls" if reason == "stop" and stream.called else reason
                    if not deltas and reason is None and not (self.want_logprobs
                                                              and response.token_ids):
                        continue
                    choices = [{"index": index, "delta": delta, "logprobs": None,
                                "finish_reason": None, "stop_reason": None}
                               for delta in deltas or [{}]]
                    choices[-1].update(finish_reason=reason, stop_reason=stop_reason)
                    if self.want_logprobs:
                        choices[0]["logprobs"] = self.serving.chat_logprobs(response,
                                                                            self.as_ids)
                    for choice in choices[:-1]:
                        yield self._chunk(chunk_kind, [choice])
                    choice = choices[-1]
                yield self._chunk(chunk_kind, [choice])
            if self.include_usage:
                yield self._chunk(chunk_kind, [], usage=self.usage())
        except ApiError as err:
            yield "data: " + json.dumps(error_body(err)) + "\n\n"
        finally:
            self.close()
        yield "data: [DONE]\n\n"

    def _chunk(self, kind: str, choices: list[dict[str, Any]], **extra: Any) -> str:
        chunk = {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                 "choices": choices}
        if self.include_usage or self.continuous_usage:
            chunk["usage"] = self.usage() if self.continuous_usage else None
        chunk.update(extra)
        return "data: " + json.dumps(chunk, ensure_ascii=False) + "\n\n"


# gRPC status -> (HTTP status, OpenAI error type)
HTTP_STATUS: dict[grpc.StatusCode, tuple[int, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNIMPLEMENTED: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}


def http_status(err: ApiError) -> int:
    """The HTTP status of an ``ApiError`` (500 for codes not in ``HTTP_STATUS``)."""
    return HTTP_STATUS.get(err.code, (500, "server_error"))[0]


def error_body(err: ApiError) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    status, kind = HTTP_STATUS.get(err.code, (500, "server_error"))
    return {"error": {"message": err.message, "type": kind, "param": err.field, "code": status}}
