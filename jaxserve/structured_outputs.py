"""Structured-output constraints of a request, shaped like vLLM's ``StructuredOutputsParams``.

Dependency-free (no jax, no llguidance): the api process validates these, the
engine compiles them (``jaxserve.engine.grammar``, llguidance) and masks the
sampler with them. Exactly one constraint is set:

- ``json``: a JSON schema (a dict, or its JSON text); the output is a JSON
  value that validates against it;
- ``json_object``: True; the output is any JSON object (OpenAI's
  ``response_format={"type": "json_object"}``);
- ``regex``: the output matches the regular expression (whole output);
- ``choice``: the output is one of these strings;
- ``grammar``: a Lark grammar (llguidance's dialect; vLLM's ``grammar``
  field); GBNF (llama.cpp's EBNF) is converted to Lark by llguidance.

The value is frozen and hashable (``choice`` becomes a tuple; equality and the
hash follow ``spec``), so it can sit in a ``SamplingParams`` and key the
engine's grammar cache.

Validation raises ``ValueError`` whose message starts with
``structured_outputs`` and the field (``structured_outputs.json: ...``), so the
API layer maps it to ``INVALID_ARGUMENT`` / HTTP 400 verbatim. Whether a
schema, regex or grammar *compiles* is known only to llguidance: the engine
finishes such a request with an error naming the field.
"""

from __future__ import annotations

import dataclasses
import json as _json
from collections.abc import Mapping
from typing import Any

FIELDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class StructuredOutputsParams:
    """One output constraint (vLLM's field names); exactly one field is set.

    Attributes:
      json: a JSON schema: a dict or its JSON text.
      json_object: True = any JSON object.
      regex: a regular expression the whole output matches.
      choice: the output is one of these non-empty strings (a tuple).
      grammar: a Lark (or GBNF) grammar.

    Raises:
      ValueError: none or several fields set, or a field of the wrong type
        (the message names ``structured_outputs.<field>``).
    """

    json: str | dict | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.json_object is False:  # False is "not set", as in vLLM
            object.__setattr__(self, "json_object", None)
        if self.choice is not None:
            if isinstance(self.choice, (str, bytes)) or not hasattr(self.choice, "__iter__"):
                raise ValueError(f"structured_outputs.choice must be a list of strings, "
                                 f"got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        set_ = [f for f in FIELDS if getattr(self, f) is not None]
        if len(set_) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(FIELDS)}; "
                             f"got {', '.join(set_) if set_ else 'none'}")
        kind = set_[0]
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    parsed = _json.loads(value)
                except ValueError as err:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {err}") from None
            elif isinstance(value, (Mapping, bool)):  # JSON Schema's true / false too
                parsed = value
            else:
                raise ValueError(f"structured_outputs.json must be a JSON schema (an object, "
                                 f"true, or its JSON text), got {type(value).__name__}")
            if not isinstance(parsed, (dict, bool)):
                raise ValueError(f"structured_outputs.json must be a JSON schema object, "
                                 f"got {parsed!r:.80}")
            if parsed is False:  # JSON Schema's "false" schema: no output could ever end
                raise ValueError("structured_outputs.json is the schema false, which no "
                                 "value matches")
        elif kind == "json_object":
            if value is not True:
                raise ValueError(f"structured_outputs.json_object must be true, got {value!r}")
        elif kind == "choice":
            if not value:
                raise ValueError("structured_outputs.choice must hold at least one string")
            for c in value:
                if not isinstance(c, str) or not c:
                    raise ValueError(f"structured_outputs.choice must hold non-empty strings, "
                                     f"got {c!r}")
        elif not isinstance(value, str) or not value:
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string, "
                             f"got {value!r:.80}")

    @property
    def kind(self) -> str:
        """The field that is set: one of ``FIELDS``."""
        return next(f for f in FIELDS if getattr(self, f) is not None)

    @property
    def spec(self) -> tuple[str, str]:
        """(kind, canonical text): what the grammar cache is keyed by.

        A schema (dict or text) is serialized with sorted keys, so a schema
        and its JSON text are equal; a choice list as JSON.
        """
        kind, value = self.kind, getattr(self, self.kind)
        if kind == "json":
            schema = _json.loads(value) if isinstance(value, str) else value
            text = _json.dumps(schema, sort_keys=True)
        elif kind == "json_object":
            text = ""
        elif kind == "choice":
            text = _json.dumps(list(value))
        else:
            text = value
        return kind, text

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StructuredOutputsParams):
            return NotImplemented
        return self.spec == other.spec

    def __hash__(self) -> int:
        return hash(self.spec)

    def to_dict(self) -> dict[str, Any]:
        """The one set field as plain JSON types (``json`` stays as given)."""
        kind = self.kind
        value = getattr(self, kind)
        return {kind: list(value) if kind == "choice" else value}

    @classmethod
    def from_value(cls, value: Any) -> "StructuredOutputsParams":
        """A ``StructuredOutputsParams`` from itself or a dict of its fields.

        Raises:
          ValueError: an unknown key or any validation error above.
        """
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"structured_outputs must be a dict (or a StructuredOutputsParams) "
                             f"with one of {', '.join(FIELDS)}, got {type(value).__name__} "
                             f"{value!r:.80}")
        unknown = sorted(set(value) - set(FIELDS))
        if unknown:
            raise ValueError(f"structured_outputs.{unknown[0]}: unknown field (known: "
                             f"{', '.join(FIELDS)})")
        return cls(**{k: v for k, v in value.items() if v is not None})
