"""Mappings between the public proto messages and jaxserve's Python values.

Used on both sides of the wire: the client builds ``SamplingParams`` messages
from keyword arguments or a ``jaxserve.SamplingParams``; the api process turns
a message back into keyword arguments (``sampling_params_kwargs_from_proto``)
and validates them (``jaxserve.validation``). Neither direction validates
ranges: that is ``SamplingParams``' job, on the server.

Presence: every scalar field of the ``SamplingParams`` message is ``optional``,
so "absent" (take the default) and "set to the default value" stay distinct.
Absent ``max_tokens`` means ``None`` (up to the context length), not
``SamplingParams``' default of 16.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from jaxserve.proto import generate_pb2 as pb
from jaxserve.sampling_params import MAX_SEED, MIN_SEED, SamplingParams
from jaxserve.structured_outputs import FIELDS, StructuredOutputsParams

SAMPLING_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SamplingParams))
_REPEATED = ("stop", "stop_token_ids")
_SEED_MODULUS = 2**64  # the wire type is uint64: a negative seed is sent as seed + 2**64

FINISH_REASONS: dict[str, int] = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "tool_calls": pb.FINISH_REASON_TOOL_CALLS,  # set by the api process, never by the engine
}
_FINISH_REASON_NAMES = {value: name for name, value in FINISH_REASONS.items()}


def sampling_params_to_proto(
        params: SamplingParams | Mapping[str, Any] | None = None) -> pb.SamplingParams:
    """A ``SamplingParams`` message from a ``SamplingParams`` or a dict of its fields.

    A ``SamplingParams`` object sets every field explicitly (so the server sees
    exactly this object). A mapping sets only its keys; ``None`` values are left
    absent. ``stop`` may be one string. Values are not range-checked here.

    Raises:
      ValueError: an unknown key, or a value the wire type cannot hold (wrong
        type, out of the int32 range, a seed beyond 64 bits); the message
        starts with the field name.
      TypeError: ``structured_outputs`` is neither a dict nor a
        ``StructuredOutputsParams``.
    """
    if params is None:
        return pb.SamplingParams()
    values = params.to_dict() if isinstance(params, SamplingParams) else dict(params)
    message = pb.SamplingParams()
    for name, value in values.items():
        if name not in SAMPLING_FIELDS:
            raise ValueError(f"{name}: unknown sampling parameter")
        if value is None:
            continue
        if name == "structured_outputs":  # its errors name their own field
            _set_structured_outputs(message.structured_outputs, value)
            continue
        try:
            _set_field(message, name, value)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{name}: cannot send {value!r}: {err}") from None
    return message


def _set_field(message: pb.SamplingParams, name: str, value: Any) -> None:
    if name == "stop":
        message.stop.extend([value] if isinstance(value, str) else list(value))
    elif name == "stop_token_ids":
        message.stop_token_ids.extend(list(value))
    elif name == "logit_bias":
        for token, bias in dict(value).items():
            message.logit_bias[int(token)] = bias
    elif name == "seed":
        if not MIN_SEED <= int(value) <= MAX_SEED:
            raise ValueError("a seed is a 64-bit integer, in [-2**63, 2**64 - 1]")
        message.seed = int(value) % _SEED_MODULUS
    else:
        setattr(message, name, value)


def _set_structured_outputs(message: pb.StructuredOutputs, value: Any) -> None:
    """Fills a ``StructuredOutputs`` message from the params or a dict of its fields.

    Values are checked by the server (``StructuredOutputsParams``, the one
    validation of every transport), only the shape here.

    Raises:
      TypeError: ``value`` is neither a ``StructuredOutputsParams`` nor a dict.
      ValueError: an unknown key (``structured_outputs.<key>``).
    """
    if isinstance(value, StructuredOutputsParams):
        values = value.to_dict()
    elif isinstance(value, Mapping):
        values = dict(value)
    else:
        raise TypeError(f"structured_outputs must be a dict (or a StructuredOutputsParams) with "
                        f"one of {', '.join(FIELDS)}, got {type(value).__name__} {value!r:.80}")
    message.SetInParent()
    for key, item in values.items():
        if item is None:
            continue
        if key == "choice":
            message.choice.extend([item] if isinstance(item, str) else list(item))
        elif key == "json" and not isinstance(item, str):
            message.json = json.dumps(item)
        elif key in ("json", "json_object", "regex", "grammar"):
            setattr(message, key, item)
        else:
            raise ValueError(f"structured_outputs.{key}: unknown field")


def _structured_outputs_kwargs(message: pb.StructuredOutputs) -> dict[str, Any]:
    out: dict[str, Any] = {name: getattr(message, name)
                           for name in ("json", "json_object", "regex", "grammar")
                           if message.HasField(name)}
    if message.choice or not out:
        # proto3 cannot tell an empty repeated field from an absent one: a
        # message with nothing set is read as the empty choice list it most
        # likely was, so the error names structured_outputs.choice.
        out["choice"] = list(message.choice)
    return out


def sampling_params_kwargs_from_proto(message: pb.SamplingParams) -> dict[str, Any]:
    """Keyword arguments for ``SamplingParams`` from a message, honouring presence.

    Absent scalars are left out (their ``SamplingParams`` default applies),
    except ``max_tokens``, which maps to ``None`` when absent. Empty
    ``stop`` / ``stop_token_ids`` / ``logit_bias`` are left out.
    """
    kwargs: dict[str, Any] = {"max_tokens": None}
    for name in SAMPLING_FIELDS:
        if name in _REPEATED:
            if getattr(message, name):
                kwargs[name] = tuple(getattr(message, name))
        elif name == "logit_bias":
            if message.logit_bias:
                kwargs[name] = dict(message.logit_bias)
        elif name == "structured_outputs":
            if message.HasField(name):
                kwargs[name] = _structured_outputs_kwargs(message.structured_outputs)
        elif message.HasField(name):
            kwargs[name] = getattr(message, name)
    return kwargs


def finish_reason_to_proto(reason: str | None) -> int:
    """``"stop"`` / ``"length"`` / ``"abort"`` / ``None`` -> ``FinishReason`` value.

    Raises:
      ValueError: any other string.
    """
    if reason is None:
        return pb.FINISH_REASON_UNSPECIFIED
    if reason not in FINISH_REASONS:
        raise ValueError(f"finish_reason must be one of {sorted(FINISH_REASONS)}, got {reason!r}")
    return FINISH_REASONS[reason]


def finish_reason_from_proto(value: int) -> str | None:
    """Inverse of ``finish_reason_to_proto``; unknown values (a newer server) -> ``None``."""
    return _FINISH_REASON_NAMES.get(value)
