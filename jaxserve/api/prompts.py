"""From a ``GenerateRequest`` to a tokenized, validated request (api process, jax-free).

``RequestPreparer.prepare(request)`` returns the prompt's token ids and the
``SamplingParams`` (``max_tokens`` resolved) or raises ``InvalidArgument``
naming the field (``jaxserve.api.validation``), or ``Unsupported`` for a
valid parameter this server cannot honour (gRPC ``UNIMPLEMENTED``).

Prompts are tokenized exactly as ``jaxserve.LLM`` does: text with
``tokenizer.encode(text)`` (the tokenizer's own special-token rule), a chat
rendered by the tokenizer's chat template and encoded without adding special
tokens again.

Besides ``SamplingParams``' own checks and ``validate_request``, the server
enforces the sampler's static widths (they are array shapes on the worker,
``jaxserve/worker/sampler/metadata.py``): at most ``MAX_LOGIT_BIAS`` logit-bias
entries, and at most ``MAX_STOP_IDS`` stop token ids plus the model's EOS ids
(EOS counted unless ``ignore_eos``); and ``n`` at most ``max_num_seqs``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxserve.api.validation import (InvalidArgument, sampling_params_from_proto,
                                     validate_chat, validate_request, validate_text)
from jaxserve.proto import generate_pb2 as pb
from jaxserve.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_IDS, SamplingParams


class Unsupported(ValueError):
    """A valid parameter this server does not support (gRPC ``UNIMPLEMENTED``)."""


@dataclasses.dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A tokenized, validated request.

    Attributes:
      prompt_token_ids: the prompt, i32[P] as ints.
      prompt_field: where the prompt came from ("text", "token_ids", "chat").
      params: validated ``SamplingParams`` with ``max_tokens`` resolved.
    """

    prompt_token_ids: list[int]
    prompt_field: str
    params: SamplingParams


class RequestPreparer:
    """Tokenizes and validates requests for one model.

    Args:
      tokenizer: the model's Hugging Face (fast) tokenizer.
      vocab_size: V, tokens.
      max_model_len: most prompt + generated tokens.
      eos_token_ids: the model's EOS ids (count against ``MAX_STOP_IDS``).
      max_num_seqs: the engine's row count (the most completions per request).
    """

    def __init__(self, tokenizer: Any, *, vocab_size: int, max_model_len: int,
                 eos_token_ids: Sequence[int], max_num_seqs: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_num_seqs = max_num_seqs

    # -------------------------------------------------------------- prompts
    def encode_text(self, text: str) -> list[int]:
        """The ids of a text prompt (as ``jaxserve.LLM``)."""
        return list(self.tokenizer.encode(text))

    def render_chat(self, chat: pb.Chat, *, field: str = "chat.messages") -> str:
        """The chat rendered by the tokenizer's chat template.

        Raises:
          InvalidArgument: no messages, a message without a role, or a chat
            the template refuses (its error message).
        """
        validate_chat(chat.messages, field=field)
        add_generation_prompt = (chat.add_generation_prompt
                                 if chat.HasField("add_generation_prompt") else True)
        messages = [{"role": m.role, "content": m.content} for m in chat.messages]
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as err:  # noqa: BLE001 - a template's own error (jinja raise_exception)
            raise InvalidArgument(field, f"the chat template refused the chat: {err}") from None

    def encode_chat(self, chat: pb.Chat, *, field: str = "chat.messages") -> tuple[str, list[int]]:
        """(rendered text, ids) of a chat; ids encoded without adding special tokens again."""
        text = self.render_chat(chat, field=field)
        return text, list(self.tokenizer.encode(text, add_special_tokens=False))

    # -------------------------------------------------------------- requests
    def prepare(self, request: pb.GenerateRequest) -> PreparedRequest:
        """Tokenizes and validates ``request``.

        Raises:
          InvalidArgument: a bad prompt or sampling parameter (the field is named).
          Unsupported: ``prompt_logprobs`` (not supported by the engine).
        """
        params = sampling_params_from_proto(request.sampling_params)
        kind = request.WhichOneof("prompt")
        if kind == "text":
            validate_text(request.text)
            ids, field = self.encode_text(request.text), "text"
        elif kind == "token_ids":
            ids, field = list(request.token_ids.ids), "token_ids"
        elif kind == "chat":
            _, ids = self.encode_chat(request.chat)
            field = "chat.messages"
        else:
            raise InvalidArgument("prompt", "set one of text, token_ids or chat")
        self.check_limits(params)
        params = validate_request(ids, params, vocab_size=self.vocab_size,
                                  max_model_len=self.max_model_len, prompt_field=field)
        return PreparedRequest(ids, kind, params)

    def check_limits(self, params: SamplingParams) -> None:
        """The server's static limits (see the module docstring).

        Raises:
          InvalidArgument / Unsupported: naming the field.
        """
        prefix = "sampling_params."
        if params.n > self.max_num_seqs:
            raise InvalidArgument(prefix + "n", f"at most {self.max_num_seqs} completions per "
                                                f"request (the server's max_num_seqs), got {params.n}")
        if params.logit_bias and len(params.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidArgument(prefix + "logit_bias",
                                  f"at most {MAX_LOGIT_BIAS} entries, got {len(params.logit_bias)}")
        num_stop = len(params.all_stop_token_ids(self.eos_token_ids))
        if num_stop > MAX_STOP_IDS:
            raise InvalidArgument(prefix + "stop_token_ids",
                                  f"at most {MAX_STOP_IDS} stop token ids including the model's "
                                  f"{len(self.eos_token_ids)} EOS ids (unless ignore_eos), got "
                                  f"{num_stop}")
        if params.prompt_logprobs is not None:
            raise Unsupported(prefix + "prompt_logprobs: not supported by this server")
