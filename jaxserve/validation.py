"""The one check of a request against the served model and the engine (jax-free, no protobuf).

Every entry point runs it: the api process (``RequestPreparer``, for gRPC
and HTTP), ``jaxserve.LLM`` and ``EngineCore.add_request``, so a request the
engine accepts is never one the worker refuses (a refused step would stop
the engine). Bad input raises ``InvalidArgument``, a ``ValueError`` naming
the field: ``str(err)`` is ``"<field>: <what is wrong>"``, with sampling
fields named ``sampling_params.<name>`` (their path in ``GenerateRequest``
and in ``EngineCoreRequest``) and the prompt by the caller's name for it.

What is checked (``RequestLimits``):

- every ``SamplingParams`` field: ``SamplingParams`` validates itself;
  ``sampling_params_from_kwargs`` maps its errors to the field;
- ``n`` <= ``max_num_seqs`` (the engine's rows);
- ``seed`` a 64-bit integer (``MIN_SEED`` .. ``MAX_SEED``), never silently
  wrapped (``SamplingParams`` itself allows any int: the engine derives
  ``seed + i`` for completion i);
- the sampler's array widths (``jaxserve.sampling_params``, imported by the
  worker's sampler): at most ``MAX_LOGIT_BIAS`` logit-bias entries, at most
  ``MAX_STOP_IDS`` stop token ids plus the model's EOS ids (EOS not counted
  with ``ignore_eos``);
- token ids inside the vocabulary: prompt, ``stop_token_ids``, ``logit_bias``;
- lengths: a non-empty prompt shorter than ``max_model_len`` (one token
  must be generated).

``RequestLimits.resolve_max_tokens`` adds the api's rule for
``max_tokens`` (prompt + max_tokens <= max_model_len, None resolved as in
vLLM's server); the engine instead caps ``max_tokens`` at the room the
prompt leaves (``jaxserve.engine.request``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from jaxserve.sampling_params import (MAX_LOGIT_BIAS, MAX_SEED, MAX_STOP_IDS, MIN_SEED,
                                      SamplingParams)

SAMPLING_PREFIX = "sampling_params."
_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
_LEADING_NAME = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)((?:\.[A-Za-z_][A-Za-z0-9_]*)?)[\s:]*")
_UNKNOWN = "unknown sampling parameter"  # SamplingParams.from_dict: "<key>: unknown ..."


class InvalidArgument(ValueError):
    """A request field is invalid (gRPC ``INVALID_ARGUMENT``, HTTP 400).

    Attributes:
      field: the field's path (``"sampling_params.top_p"``, ``"token_ids"``).
      reason: what is wrong with it (``"must be in (0, 1], got 1.5"``).
    """

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class Unsupported(InvalidArgument, NotImplementedError):
    """A valid parameter this server does not support (gRPC ``UNIMPLEMENTED``).

    Attributes: as ``InvalidArgument`` (``field``, ``reason``). Also a
    ``NotImplementedError``, which the engine service maps to UNIMPLEMENTED.
    """


def sampling_params_from_kwargs(kwargs: Mapping[str, Any]) -> SamplingParams:
    """``SamplingParams(**kwargs)`` with its errors mapped to the field.

    Raises:
      InvalidArgument: field ``sampling_params.<name>`` for an unknown key or
        any value ``SamplingParams`` rejects.
    """
    try:
        return SamplingParams.from_dict(kwargs)
    except (ValueError, TypeError) as err:
        raise _sampling_error(str(err)) from None


def _sampling_error(message: str) -> InvalidArgument:
    """Maps a ``SamplingParams`` error message ("top_p must be ...") to its field."""
    match = _LEADING_NAME.match(message)
    if match is not None and (match.group(1) in _SAMPLING_FIELDS
                              or message[match.end():].startswith(_UNKNOWN)):
        return InvalidArgument(SAMPLING_PREFIX + match.group(1) + match.group(2),
                               message[match.end():])
    return InvalidArgument("sampling_params", message)


def check_token_ids(token_ids: Iterable[int], *, vocab_size: int, field: str) -> None:
    """Every id must be in ``[0, vocab_size)``.

    Raises:
      InvalidArgument: ``field``, naming the first bad id and its position.
    """
    for position, token_id in enumerate(token_ids):
        if not 0 <= token_id < vocab_size:
            raise InvalidArgument(field, f"token id {token_id} at position {position} is "
                                         f"outside the vocabulary [0, {vocab_size})")


@dataclasses.dataclass(frozen=True, slots=True)
class RequestLimits:
    """The served model's and engine's limits on one request (see the module docstring).

    Attributes:
      vocab_size: V, tokens.
      max_model_len: most prompt + generated tokens per sequence.
      max_num_seqs: the engine's rows: the most completions (``n``) per request.
      eos_token_ids: the model's EOS ids (they count against ``MAX_STOP_IDS``).
    """

    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", tuple(int(i) for i in self.eos_token_ids))

    def check_params(self, params: SamplingParams) -> None:
        """The limits on already-valid sampling parameters (no prompt needed).

        Raises:
          InvalidArgument: ``sampling_params.n`` above ``max_num_seqs``;
            ``sampling_params.seed`` outside [``MIN_SEED``, ``MAX_SEED``];
            ``sampling_params.logit_bias`` with more than ``MAX_LOGIT_BIAS``
            entries or an id outside the vocabulary;
            ``sampling_params.stop_token_ids`` with more than ``MAX_STOP_IDS``
            ids counting EOS, or an id outside the vocabulary.
        """
        if params.n > self.max_num_seqs:
            raise InvalidArgument(SAMPLING_PREFIX + "n",
                                  f"at most {self.max_num_seqs} completions per request "
                                  f"(the server's max_num_seqs), got {params.n}")
        if params.seed is not None and not MIN_SEED <= params.seed <= MAX_SEED:
            raise InvalidArgument(SAMPLING_PREFIX + "seed",
                                  f"must be a 64-bit integer (int64 or uint64), in [-2**63, "
                                  f"2**64 - 1], got {params.seed}")
        if params.logit_bias and len(params.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidArgument(SAMPLING_PREFIX + "logit_bias",
                                  f"at most {MAX_LOGIT_BIAS} entries, got {len(params.logit_bias)}")
        num_stop = len(params.all_stop_token_ids(self.eos_token_ids))
        if num_stop > MAX_STOP_IDS:
            raise InvalidArgument(SAMPLING_PREFIX + "stop_token_ids",
                                  f"at most {MAX_STOP_IDS} stop token ids including the model's "
                                  f"{len(self.eos_token_ids)} EOS ids (unless ignore_eos), got "
                                  f"{num_stop}")
        check_token_ids(params.stop_token_ids, vocab_size=self.vocab_size,
                        field=SAMPLING_PREFIX + "stop_token_ids")
        if params.logit_bias:
            check_token_ids(sorted(params.logit_bias), vocab_size=self.vocab_size,
                            field=SAMPLING_PREFIX + "logit_bias")

    def check_prompt(self, prompt_token_ids: Sequence[int], *, prompt_field: str) -> None:
        """A prompt (i32[P] as ints) must be non-empty, in the vocabulary, with room to generate.

        Raises:
          InvalidArgument: ``prompt_field``.
        """
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise InvalidArgument(prompt_field, "the prompt must not be empty")
        check_token_ids(prompt_token_ids, vocab_size=self.vocab_size, field=prompt_field)
        if num_prompt >= self.max_model_len:
            raise InvalidArgument(prompt_field,
                                  f"the prompt is {num_prompt} tokens; the model's maximum "
                                  f"context length (max_model_len) is {self.max_model_len} "
                                  f"tokens, which leaves no room to generate")

    def check(self, prompt_token_ids: Sequence[int], params: SamplingParams, *,
              prompt_field: str) -> None:
        """``check_params`` then ``check_prompt``: all the engine and the worker need.

        Raises:
          InvalidArgument / Unsupported: naming the field.
        """
        self.check_params(params)
        self.check_prompt(prompt_token_ids, prompt_field=prompt_field)

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                 prompt_field: str, default_max_tokens: int | None = None) -> SamplingParams:
        """``check``, then ``resolve_max_tokens``: the api's whole validation of a request.

        Raises:
          InvalidArgument / Unsupported: naming the field.
        """
        self.check(prompt_token_ids, params, prompt_field=prompt_field)
        return self.resolve_max_tokens(len(prompt_token_ids), params,
                                       default_max_tokens=default_max_tokens)

    def resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams, *,
                           default_max_tokens: int | None = None) -> SamplingParams:
        """``params`` with ``max_tokens`` checked against the room the prompt leaves.

        Args:
          num_prompt_tokens: P, a prompt length ``check_prompt`` accepted.
          params: valid sampling parameters; ``max_tokens`` None = not set.
          default_max_tokens: the model's default reply length in tokens (its
            ``generation_config.json`` ``max_new_tokens``), used when
            ``params.max_tokens`` is None; None = no default.

        Returns:
          ``params``, with ``max_tokens=None`` replaced by the room left,
          ``max_model_len - P``, or by ``default_max_tokens`` when that is
          smaller (but never below ``min_tokens``): vLLM's rule, a default
          never makes a request too long.

        Raises:
          InvalidArgument: P + max_tokens beyond ``max_model_len``
            (``sampling_params.max_tokens``); an unset max_tokens with
            ``min_tokens`` beyond the room left (``sampling_params.min_tokens``).
        """
        room = self.max_model_len - num_prompt_tokens
        if params.max_tokens is None:
            if params.min_tokens > room:
                raise InvalidArgument(SAMPLING_PREFIX + "min_tokens",
                                      f"min_tokens {params.min_tokens} plus the prompt's "
                                      f"{num_prompt_tokens} tokens exceed the model's maximum "
                                      f"context length of {self.max_model_len} tokens")
            if default_max_tokens is not None:
                room = min(room, max(default_max_tokens, params.min_tokens))
            return dataclasses.replace(params, max_tokens=room)
        if params.max_tokens > room:
            raise InvalidArgument(SAMPLING_PREFIX + "max_tokens",
                                  f"the prompt ({num_prompt_tokens} tokens) plus max_tokens "
                                  f"({params.max_tokens}) is "
                                  f"{num_prompt_tokens + params.max_tokens} tokens, beyond the "
                                  f"model's maximum context length of {self.max_model_len}")
        return params
