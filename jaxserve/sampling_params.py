"""User-facing sampling parameters, shaped like vLLM's ``SamplingParams``.

Dependency-free (no jax, no numpy): the api and engine processes import this
module. A ``SamplingParams`` is a frozen, hashable value: ``stop`` and
``stop_token_ids`` are normalized to tuples and ``logit_bias`` to a read-only
dict, so the object can key a cache or cross a process boundary (pickle).

Field meanings follow vLLM (``vllm/sampling_params.py``) and, where vLLM
follows it, the OpenAI API:

- ``temperature`` below ``SAMPLING_EPS`` (1e-5, vLLM's ``_SAMPLING_EPS``) means
  greedy decoding; top-k / top-p / min-p are then ignored.
- ``top_k`` of 0 or -1 turns top-k off (so does any k >= vocab size).
- ``repetition_penalty`` divides positive and multiplies negative logits of
  tokens seen in the prompt or the output (CTRL, Keskar et al. 2019);
  ``presence_penalty`` / ``frequency_penalty`` subtract a constant / a
  per-occurrence amount for tokens seen in the output (OpenAI's definition).
- ``logprobs`` = N returns the sampled token's logprob plus the top N
  (0 = only the sampled token), N <= ``MAX_LOGPROBS`` (20).
- ``min_tokens``: EOS and ``stop_token_ids`` are banned until that many tokens
  have been generated.

Validation raises ``ValueError`` whose message starts with the field's name,
so the API layer can map it to ``INVALID_ARGUMENT`` verbatim.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

from jaxserve.structured_outputs import StructuredOutputsParams

MAX_INT32 = 2**31 - 1  # the wire type of the integer fields (generate.proto, engine.proto)
SAMPLING_EPS = 1e-5  # temperature below this is greedy (vLLM's _SAMPLING_EPS)
MAX_LOGPROBS = 20  # most top logprobs per token, as vLLM's default max_logprobs
# A seed is 64 bits: an int64 or a uint64 (generate.proto's type); a negative seed is the same
# key as seed + 2**64. jaxserve.validation.RequestLimits rejects seeds outside this range.
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1
LOGIT_BIAS_LIMIT = 100.0  # a logit_bias value is in [-100, 100] (OpenAI's documented range)
# The sampler's array widths (jaxserve.worker.sampler.metadata imports these;
# jaxserve.validation checks requests against them, counting the model's EOS ids):
MAX_LOGIT_BIAS = 64  # most logit_bias entries per request
MAX_STOP_IDS = 16  # most stop_token_ids + EOS ids per request (EOS not with ignore_eos)

_FLOAT_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty",
                 "temperature", "top_p", "min_p")
_BOOL_FIELDS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                "spaces_between_special_tokens")


class FrozenDict(dict):
    """A read-only, hashable ``dict`` (used for ``logit_bias``).

    Reads behave as a plain dict (and ``isinstance(x, dict)`` holds); every
    mutating method raises ``TypeError``. Pickles as a plain copy.
    """

    __slots__ = ()

    def _readonly(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("SamplingParams.logit_bias is read-only")

    __setitem__ = __delitem__ = __ior__ = _readonly  # type: ignore[assignment]
    clear = pop = popitem = setdefault = update = _readonly  # type: ignore[assignment]

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(frozenset(self.items()))

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (dict(self),))

    def __repr__(self) -> str:
        return repr(dict(self))


def _is_int(value: Any) -> bool:
    """True for ints (and int-like objects such as numpy ints), not bools."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    return hasattr(value, "__index__") and not isinstance(value, float)


def _as_int(name: str, value: Any) -> int:
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value.__index__())


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(
            value, "__float__"):
        raise ValueError(f"{name} must be a number, got {value!r}")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{name} must be finite, got {out}")
    return out


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request's completion (vLLM's fields and defaults).

    Attributes:
      n: completions per prompt, >= 1.
      presence_penalty: subtracted once from every token present in the
        output; in [-2, 2].
      frequency_penalty: subtracted per occurrence in the output; in [-2, 2].
      repetition_penalty: > 0; 1 = off. Applies to prompt and output tokens.
      temperature: >= 0; below ``SAMPLING_EPS`` = greedy.
      top_p: nucleus mass in (0, 1]; 1 = off.
      top_k: -1 or 0 = off, else keep the k most likely tokens (ties kept);
        at most ``MAX_INT32`` (the wire's int32; any k >= V is off anyway).
      min_p: in [0, 1]; drop tokens with probability < min_p * max probability.
      seed: per-request seed or None for the server's random stream; a
        request's seed must be in [``MIN_SEED``, ``MAX_SEED``] (int64 or
        uint64; checked by ``RequestLimits``, since the engine derives
        ``seed + i`` for completion i and the worker takes seeds modulo 2**64).
        Seeded draws depend only on (seed, position).
      stop: strings that end the completion (normalized to a tuple).
      stop_token_ids: token ids that end the completion (normalized to a tuple).
      ignore_eos: keep generating after EOS.
      max_tokens: most generated tokens, >= 1; None = up to the context length.
      min_tokens: EOS and stop token ids are banned until this many tokens
        were generated; 0 <= min_tokens <= max_tokens.
      logprobs: None, or N in [0, 20]: the sampled token's logprob plus top N.
      prompt_logprobs: None, or N in [0, 20] for every prompt token.
      logit_bias: {token id: bias added to its logit}, read-only; biases in
        [-100, 100] (``LOGIT_BIAS_LIMIT``); string keys holding integers (as
        JSON sends them) are accepted and converted.
      include_stop_str_in_output: keep the matched stop string in the text.
      skip_special_tokens: drop special tokens when detokenizing.
      spaces_between_special_tokens: detokenizer option, as in vLLM.
      structured_outputs: None, or a ``StructuredOutputsParams`` (or a dict of
        its fields): the output follows a JSON schema, regex, choice or
        grammar (``jaxserve.structured_outputs``). Not with ``ignore_eos`` nor
        ``min_tokens`` > 0 (the grammar decides where the output may end).

    Raises:
      ValueError: a field is out of range, of the wrong type, NaN or
        infinite; the message starts with the field's name.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: Mapping[int, float] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        setattr_ = object.__setattr__
        for name in _FLOAT_FIELDS:
            setattr_(self, name, _as_float(name, getattr(self, name)))
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        setattr_(self, "n", _as_int("n", self.n))
        setattr_(self, "top_k", _as_int("top_k", self.top_k))
        setattr_(self, "min_tokens", _as_int("min_tokens", self.min_tokens))
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                setattr_(self, name, _as_int(name, value))
        setattr_(self, "stop", _normalize_stop(self.stop))
        setattr_(self, "stop_token_ids", _normalize_token_ids(self.stop_token_ids))
        if self.logit_bias is not None:
            setattr_(self, "logit_bias", _normalize_logit_bias(self.logit_bias))
        if self.structured_outputs is not None:
            setattr_(self, "structured_outputs",
                     StructuredOutputsParams.from_value(self.structured_outputs))
        self._check_ranges()
        self._check_structured_outputs()

    def _check_ranges(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not -1 <= self.top_k <= MAX_INT32:
            raise ValueError(f"top_k must be -1, 0 (off) or in [1, {MAX_INT32}], got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), "
                             f"got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")

    def _check_structured_outputs(self) -> None:
        if self.structured_outputs is None:
            return
        if self.ignore_eos:
            raise ValueError("structured_outputs cannot be combined with ignore_eos: the "
                             "grammar decides where the output ends")
        if self.min_tokens > 0:
            raise ValueError(f"structured_outputs cannot be combined with min_tokens > 0 "
                             f"(got {self.min_tokens}): the grammar decides where the output "
                             f"may end")

    @property
    def is_greedy(self) -> bool:
        """True when the temperature selects greedy decoding."""
        return self.temperature < SAMPLING_EPS

    def all_stop_token_ids(self, eos_token_ids: Iterable[int] = ()) -> tuple[int, ...]:
        """The ids that end the completion: ``stop_token_ids`` plus EOS.

        EOS is left out when ``ignore_eos`` is set. These are also the ids that
        ``min_tokens`` bans, as in vLLM.
        """
        ids = list(self.stop_token_ids)
        if not self.ignore_eos:
            ids.extend(int(i) for i in eos_token_ids)
        return tuple(dict.fromkeys(ids))

    def to_dict(self) -> dict[str, Any]:
        """Plain Python types (lists, dict), JSON-serializable except int keys."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["stop"] = list(self.stop)
        out["stop_token_ids"] = list(self.stop_token_ids)
        out["logit_bias"] = None if self.logit_bias is None else dict(self.logit_bias)
        so = self.structured_outputs
        out["structured_outputs"] = None if so is None else so.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SamplingParams":
        """Inverse of ``to_dict``; missing keys take their defaults.

        Raises:
          ValueError: an unknown key, or any validation error of the fields.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown sampling parameter")
        return cls(**dict(data))


def _normalize_stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, Iterable):
        raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
    out = tuple(stop)
    for s in out:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop must hold non-empty strings, got {s!r}")
    return out


def _normalize_token_ids(ids: Any) -> tuple[int, ...]:
    if ids is None:
        return ()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise ValueError(f"stop_token_ids must be a list of integers, got {ids!r}")
    out = tuple(_as_int("stop_token_ids", i) for i in ids)
    for i in out:
        if i < 0:
            raise ValueError(f"stop_token_ids must be >= 0, got {i}")
    return out


def _normalize_logit_bias(bias: Any) -> FrozenDict:
    if not isinstance(bias, Mapping):
        raise ValueError(f"logit_bias must be a mapping of token id to bias, got {bias!r}")
    out = {}
    for key, value in bias.items():
        if isinstance(key, str):
            try:
                key = int(key)
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
        token = _as_int("logit_bias", key)
        if token < 0:
            raise ValueError(f"logit_bias token ids must be >= 0, got {token}")
        out[token] = _as_float("logit_bias", value)
        if abs(out[token]) > LOGIT_BIAS_LIMIT:
            raise ValueError(f"logit_bias values must be in [-{LOGIT_BIAS_LIMIT:g}, "
                             f"{LOGIT_BIAS_LIMIT:g}], got {out[token]} for token {token}")
    return FrozenDict(out)
