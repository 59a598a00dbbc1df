"""OpenAI Completions and Chat Completions over ``RequestRunner`` (jax-free).

The HTTP transport's half of "one implementation, two transports": a request
body becomes the same ``PreparedRequest`` a gRPC ``GenerateRequest`` becomes
(``RequestPreparer``: tokenization, the chat template, the model's default
sampling parameters, every limit), runs through the same ``RequestRunner``
(admission, the engine, detokenization, stop strings, aborts), and the
resulting ``GenerateResponse`` messages are rendered as OpenAI JSON objects
— whole, or as Server-Sent Events chunks ending with ``data: [DONE]``
(``OpenAIResult``, ``jaxserve.api.openai.responses``).

Errors are ``ApiError``s naming the OpenAI parameter (``param``): the
preparer's field names (``sampling_params.top_p``, ``text``,
``chat.messages``) are mapped to the request's own (``top_p``, ``prompt``,
``messages``).

Chat requests with ``tools`` get a ``ToolCallPlan`` (``jaxserve.api.tool_calling``):
its JSON schema becomes the request's structured outputs (``required``, a
named function), and its parser turns each choice's text into
``message.tool_calls`` — or, streamed, ``delta.tool_calls`` through a
``ToolCallStream`` per choice — with finish reason ``tool_calls``.

Response shapes follow the OpenAI API reference; ``stop_reason`` (the stop
string or stop token id that ended a choice, else null),
``prompt_tokens_details.cached_tokens`` (prompt tokens served from the prefix
cache) and ``prompt_logprobs`` are as in vLLM's server. ``prompt_logprobs``
(vLLM's extra request field, N) adds, to each completions choice or to a chat
response, ``[null, {"<token id>": {"logprob", "rank", "decoded_token"}},
...]``: per prompt token its logprob given the tokens before it and the top
N; as vLLM, not with ``stream``. ``echo`` with ``logprobs`` computes the
prompt's logprobs (N = ``logprobs``) and puts them before the generated
tokens' in the choice's ``logprobs``, streamed too.
"""

from __future__ import annotations

import contextlib
import functools
import json
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from jaxserve.api.openai.protocol import (UNSUPPORTED_FIELDS, ChatCompletionRequest,
                                          CompletionRequest, SamplingFields, named_choice)
from jaxserve.api.openai.responses import OpenAIResult
from jaxserve.api.prompts import PreparedRequest
from jaxserve.api.runner import ApiError, RequestRunner, RunningRequest
from jaxserve.api.tool_calling import NO_TOOLS, ToolCallPlan, ToolChoiceError, plan_tool_calls
from jaxserve.api.tool_parsers import ToolParser
from jaxserve.outputs import finite_logprob
from jaxserve.proto import generate_pb2 as pb

# SamplingFields that map one-to-one onto SamplingParams fields.
_DIRECT_FIELDS = ("n", "temperature", "top_p", "stop", "seed", "presence_penalty",
                  "frequency_penalty", "top_k", "min_p", "repetition_penalty", "min_tokens",
                  "ignore_eos", "stop_token_ids", "include_stop_str_in_output",
                  "skip_special_tokens", "spaces_between_special_tokens")


def bad_request(runner: RequestRunner, param: str, reason: str) -> ApiError:
    """A 400 naming ``param`` (counted as a rejected request)."""
    return runner.reject(grpc.StatusCode.INVALID_ARGUMENT, f"{param}: {reason}", param)


def check_model(runner: RequestRunner, model: str | None) -> None:
    """``model`` must be the served model's name (None means it).

    Raises:
      ApiError: ``NOT_FOUND`` (HTTP 404), param ``model``.
    """
    if model is not None and model != runner.model_name:
        raise runner.reject(grpc.StatusCode.NOT_FOUND,
                            f"model: the model {model!r} does not exist; this server serves "
                            f"{runner.model_name!r}", "model")


class OpenAIServing:
    """Runs OpenAI requests; one per api process.

    Args:
      runner: the api process's request runner.
      tool_parser: the ``--tool-call-parser`` that reads ``tool_choice="auto"``
        replies (``--enable-auto-tool-choice``), or None: ``auto`` is refused.
    """

    def __init__(self, runner: RequestRunner, tool_parser: ToolParser | None = None) -> None:
        self.runner = runner
        self.tool_parser = tool_parser
        self.tokenizer = runner.preparer.tokenizer
        self._token_text = functools.lru_cache(maxsize=65536)(self._decode_one)

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    # ------------------------------------------------------------- requests
    def _params(self, body: SamplingFields, *, max_tokens: int | None, max_tokens_param: str,
                logprobs: int | None, logprobs_param: str, prompt_logprobs: int | None = None,
                tools: ToolCallPlan = NO_TOOLS):
        """Validated ``SamplingParams`` from the body's explicit fields (and the tool plan's
        constraint and special-token rule)."""
        for name, allowed in UNSUPPORTED_FIELDS.items():
            if name in type(body).model_fields and getattr(body, name) not in allowed:
                raise bad_request(self.runner, name, "not supported by this server")
        if body.stream_options is not None and not body.stream:
            raise bad_request(self.runner, "stream_options", "only allowed when stream is true")
        kwargs: dict[str, Any] = {name: getattr(body, name) for name in _DIRECT_FIELDS
                                  if getattr(body, name) is not None}
        if max_tokens is not None:
            kwargs["max_tokens"] = max_tokens
        if logprobs is not None:
            kwargs["logprobs"] = logprobs
        if body.prompt_logprobs is not None and body.stream:
            raise bad_request(self.runner, "prompt_logprobs", "not available with stream: true")
        if prompt_logprobs is not None:
            kwargs["prompt_logprobs"] = prompt_logprobs
        if body.logit_bias is not None:
            bias = {}
            for key, value in body.logit_bias.items():
                try:
                    bias[int(key)] = value
                except ValueError:
                    raise bad_request(self.runner, "logit_bias",
                                      f"keys must be token ids, got {key!r}") from None
            kwargs["logit_bias"] = bias
        renames = {"max_tokens": max_tokens_param, "logprobs": logprobs_param}
        structured = self._structured_outputs(body)
        try:
            tools.constrain(kwargs, other_constraint=structured and structured[1])
        except ToolChoiceError as err:
            raise bad_request(self.runner, "tool_choice", str(err)) from None
        if tools.schema is not None:
            renames.update({"structured_outputs": "tool_choice",
                            "structured_outputs.json": "tools"})
        elif structured is not None:
            kwargs["structured_outputs"], source = structured
            if source == "response_format":
                renames.update({"structured_outputs": "response_format",
                                "structured_outputs.json": "response_format.json_schema.schema",
                                "structured_outputs.json_object": "response_format"})
        with self._errors(renames):
            return self.runner.preparer.sampling_params(kwargs)

    def _structured_outputs(self, body: SamplingFields) -> tuple[dict[str, Any], str] | None:
        """(structured outputs, the field they came from) of ``response_format`` (OpenAI's:
        ``text``, ``json_object``, ``json_schema``) or ``structured_outputs`` (vLLM's); None."""
        fmt = body.response_format
        if fmt is not None and fmt.json_schema is not None and fmt.type != "json_schema":
            raise bad_request(self.runner, "response_format.json_schema",
                              f"only allowed with type json_schema, got type {fmt.type!r}")
        if fmt is not None and fmt.type != "text":
            if body.structured_outputs is not None:
                raise bad_request(self.runner, "structured_outputs",
                                  "set structured_outputs or response_format, not both")
            if fmt.type == "json_object":
                return {"json_object": True}, "response_format"
            if fmt.json_schema is None:
                raise bad_request(self.runner, "response_format.json_schema",
                                  "needs a schema (an object): {\"name\": ..., \"schema\": "
                                  "{...}}")
            schema = fmt.json_schema.json_schema
            return {"json": schema}, "response_format"
        if body.structured_outputs is not None:
            return dict(body.structured_outputs), "structured_outputs"
        return None

    @contextlib.contextmanager
    def _errors(self, renames: dict[str, str]) -> Iterator[None]:
        """``runner.preparer_errors()`` with ``sampling_params.<name>`` mapped to the request's
        parameter (``renames``, else ``<name>``); prompt fields are named by the caller."""
        try:
            with self.runner.preparer_errors():
                yield
        except ApiError as err:
            field = err.field or ""
            if not field.startswith("sampling_params."):
                raise
            name = field.removeprefix("sampling_params.")
            param = renames.get(name, name)
            raise ApiError(err.code, param + err.message[len(field):], param) from None

    def _prepare_tokens(self, ids: Sequence[int], params, prompt_param: str,
                        renames: dict[str, str]) -> PreparedRequest:
        with self._errors(renames):
            return self.runner.preparer.prepare_tokens(ids, params, prompt_field=prompt_param)

    def completion_prompts(self, body: CompletionRequest) -> list[tuple[list[int], str]]:
        """(token ids, echo text) per prompt of a completions request."""
        prompt = body.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompts: list[Any] = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise bad_request(self.runner, "prompt", "must not be empty")
        out = []
        for i, item in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if isinstance(item, str):
                if not item:
                    raise bad_request(self.runner, param, "the prompt must not be empty")
                out.append((self.runner.preparer.encode_text(item), item))
            else:
                out.append((list(item), self.tokenizer.decode(item) if body.echo else ""))
        return out

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        """The token ids of a chat request's messages, rendered by the chat template."""
        messages = []
        for i, message in enumerate(body.messages):
            content = message.content
            if content is None and message.role != "assistant":
                raise bad_request(self.runner, f"messages[{i}].content",
                                  f"required for a {message.role!r} message")
            if isinstance(content, list):
                parts = []
                for j, part in enumerate(content):
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise bad_request(self.runner, f"messages[{i}].content[{j}]",
                                          "only text parts ({\"type\": \"text\", \"text\": "
                                          "...}) are supported")
                    parts.append(part["text"])
                content = "".join(parts)
            calls = [pb.ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
                     for c in message.tool_calls or ()]
            messages.append(pb.ChatMessage(role=message.role, content=content or "",
                                           tool_calls=calls,
                                           tool_call_id=message.tool_call_id or ""))
        tools = [pb.Tool(name=t.function.name, description=t.function.description or "",
                         parameters=json.dumps(t.function.parameters)
                         if t.function.parameters is not None else "")
                 for t in body.tools or ()]
        chat = pb.Chat(messages=messages, add_generation_prompt=body.add_generation_prompt,
                       tools=tools)
        with self._errors({}):
            return self.runner.preparer.encode_chat(chat, field="messages", tools_field="tools",
                                                    arguments_path="function.arguments")[1]

    def tool_plan(self, body: ChatCompletionRequest) -> ToolCallPlan:
        """The request's ``ToolCallPlan`` (``jaxserve.api.tool_calling``).

        Raises:
          ApiError: 400 naming ``tool_choice`` for ``auto`` on a server without
            ``--enable-auto-tool-choice``.
        """
        try:
            return plan_tool_calls({t.function.name: t.function.parameters
                                    for t in body.tools or ()}, named_choice(body.tool_choice),
                                   auto_parser=self.tool_parser,
                                   parallel=body.parallel_tool_calls is not False)
        except ToolChoiceError as err:
            raise bad_request(self.runner, "tool_choice", str(err)) from None

    def _admissible(self, body: SamplingFields) -> None:
        """Serving, and the body names the served model (or none)."""
        self.runner.check_ready()
        check_model(self.runner, body.model)

    async def _run(self, kind: str, id_prefix: str, prepared: list[PreparedRequest],
                   body: SamplingFields, echo: list[str] | None,
                   tools: ToolCallPlan = NO_TOOLS) -> OpenAIResult:
        """Starts one engine request per prompt (all or none) and wraps them."""
        request_id = body.request_id or f"{id_prefix}-{uuid.uuid4().hex}"
        started: list[RunningRequest] = []
        try:
            for i, p in enumerate(prepared):
                rid = request_id if len(prepared) == 1 else f"{request_id}-{i}"
                started.append(await self.runner.start(p, request_id=rid, stream=body.stream,
                                                       cache_salt=body.cache_salt or ""))
        except ApiError as err:
            for running in started:
                running.close()
            # The engine refuses a schema / regex / grammar that does not compile.
            field = err.field or ""
            if not field.startswith("sampling_params.structured_outputs"):
                raise
            fmt = body.response_format
            param = ("tools" if tools.schema is not None
                     else "response_format" if fmt is not None and fmt.type != "text"
                     else field.removeprefix("sampling_params."))
            raise ApiError(err.code, param + err.message[len(field):], param) from None
        except BaseException:
            for running in started:
                running.close()
            raise
        return OpenAIResult(self, kind, request_id, started, prepared, echo=echo, tools=tools,
                            include_usage=bool(body.stream_options
                                               and body.stream_options.include_usage),
                            as_ids=body.return_tokens_as_token_ids,
                            continuous_usage=bool(body.stream_options and body.stream_options
                                                  .continuous_usage_stats))

    # ---------------------------------------------------------- completions
    async def completions(self, body: CompletionRequest) -> OpenAIResult:
        """Runs ``POST /v1/completions``.

        Raises:
          ApiError: before anything is sent (bad input, queue full, not serving).
        """
        self._admissible(body)
        if body.best_of is not None and body.best_of != (body.n or 1):
            raise bad_request(self.runner, "best_of", "only best_of == n is supported")
        prompt_logprobs = body.prompt_logprobs
        if prompt_logprobs is None and body.echo:  # the echoed tokens' logprobs (vLLM's rule)
            prompt_logprobs = body.logprobs
        params = self._params(body, max_tokens=body.max_tokens, max_tokens_param="max_tokens",
                              logprobs=body.logprobs, logprobs_param="logprobs",
                              prompt_logprobs=prompt_logprobs)
        prompts = self.completion_prompts(body)
        prepared = [self._prepare_tokens(ids, params, "prompt" if len(prompts) == 1
                                         else f"prompt[{i}]", {"max_tokens": "max_tokens"})
                    for i, (ids, _) in enumerate(prompts)]
        return await self._run("text_completion", "cmpl", prepared, body,
                               [text for _, text in prompts] if body.echo else None)

    async def chat_completions(self, body: ChatCompletionRequest) -> OpenAIResult:
        """Runs ``POST /v1/chat/completions``.

        Raises:
          ApiError: before anything is sent (bad input, queue full, not serving).
        """
        self._admissible(body)
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise bad_request(self.runner, "max_completion_tokens",
                              "set max_completion_tokens or max_tokens, not both")
        max_param = ("max_completion_tokens" if body.max_completion_tokens is not None
                     else "max_tokens")
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request(self.runner, "top_logprobs", "needs logprobs: true")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        tools = self.tool_plan(body)
        params = self._params(body, max_tokens=body.max_completion_tokens or body.max_tokens,
                              max_tokens_param=max_param, logprobs=logprobs,
                              logprobs_param="top_logprobs",
                              prompt_logprobs=body.prompt_logprobs, tools=tools)
        prepared = [self._prepare_tokens(self.chat_prompt(body), params, "messages",
                                         {"max_tokens": max_param})]
        return await self._run("chat.completion", "chatcmpl", prepared, body, None, tools)

    # ------------------------------------------------------------ logprobs
    def token_text(self, token_id: int, as_id: bool) -> str:
        """A logprob entry's ``token``: its text, or ``"token_id:<id>"`` (vLLM's
        ``return_tokens_as_token_ids``)."""
        return f"token_id:{token_id}" if as_id else self._token_text(token_id)

    def completion_logprobs(self, response: pb.GenerateResponse, offset: int,
                            as_ids: bool) -> dict[str, Any]:
        """The Completions ``logprobs`` of one response's tokens (text offsets from ``offset``).

        Here and in ``chat_logprobs`` every logprob goes through ``finite_logprob``:
        a token masked by structured outputs (-inf) is reported as -9999.0.
        """
        tokens = [self.token_text(t, as_ids) for t in response.token_ids]
        text_offset = []
        for token in tokens:
            text_offset.append(offset)
            offset += len(token)
        return {"tokens": tokens,
                "token_logprobs": [finite_logprob(lp.logprob) for lp in response.logprobs],
                "top_logprobs": [{self.token_text(t, as_ids): finite_logprob(v) for t, v in
                                  zip(lp.top_token_ids, lp.top_logprobs)}
                                 for lp in response.logprobs],
                "text_offset": text_offset}

    def echo_logprobs(self, prompt_ids: Sequence[int], response: pb.GenerateResponse,
                      as_ids: bool) -> dict[str, Any]:
        """The Completions ``logprobs`` of an echoed prompt.

        ``response.prompt_logprobs`` holds one entry per prompt token after
        the first, whose ``token_logprobs`` and ``top_logprobs`` are null.
        Text offsets count the tokens' decoded text from 0 (with ``as_ids``
        too), so they lead up to the generated tokens' at the echo's end.
        """
        tokens = [self.token_text(t, as_ids) for t in prompt_ids]
        text_offset, offset = [], 0
        for token_id in prompt_ids:
            text_offset.append(offset)
            offset += len(self._token_text(token_id))
        scored = response.prompt_logprobs
        return {"tokens": tokens,
                "token_logprobs": [None] + [finite_logprob(lp.logprob) for lp in scored],
                "top_logprobs": [None] + [{self.token_text(t, as_ids): finite_logprob(v)
                                           for t, v in zip(lp.top_token_ids, lp.top_logprobs)}
                                          for lp in scored],
                "text_offset": text_offset}

    def prompt_logprobs(self, prompt_ids: Sequence[int],
                        response: pb.GenerateResponse) -> list[dict[str, Any] | None]:
        """vLLM's ``prompt_logprobs``: null, then per prompt token {id: {"logprob", "rank",
        "decoded_token"}} holding that token and the top N (ranks 1..N)."""
        out: list[dict[str, Any] | None] = [None]
        for token_id, lp in zip(prompt_ids[1:], response.prompt_logprobs):
            entry = {str(t): {"logprob": finite_logprob(v), "rank": i + 1,
                              "decoded_token": self._token_text(t)}
                     for i, (t, v) in enumerate(zip(lp.top_token_ids, lp.top_logprobs))}
            entry[str(token_id)] = {"logprob": finite_logprob(lp.logprob), "rank": lp.rank,
                                    "decoded_token": self._token_text(token_id)}
            out.append(entry)
        return out

    def chat_logprobs(self, response: pb.GenerateResponse, as_ids: bool) -> dict[str, Any]:
        """The Chat Completions ``logprobs`` object of one response's tokens."""
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.token_text(token_id, as_ids)
            return {"token": text, "logprob": finite_logprob(logprob),
                    "bytes": list(text.encode())}

        content = []
        for token_id, lp in zip(response.token_ids, response.logprobs):
            item = entry(token_id, lp.logprob)
            item["top_logprobs"] = [entry(t, v) for t, v in zip(lp.top_token_ids, lp.top_logprobs)]
            content.append(item)
        return {"content": content}
