"""Structured outputs in the engine: grammars compiled off the step path, one matcher per sequence.

llguidance (jax-free, no torch) does the work: it turns a JSON schema,
regex, choice list or Lark grammar into a grammar, and an ``LLMatcher`` over
the model's tokenizer gives the allowed-token bitmask of the next step and
consumes each sampled token.

Contract (``jaxserve.engine.core`` drives it):

- ``GrammarCompiler.submit(params)`` returns a ``Future`` of a
  ``CompiledGrammar`` at once; the compile runs in a small thread pool
  (``max_workers``, default 2) and results are kept in an LRU cache keyed by
  ``StructuredOutputsParams.spec`` (failures too: a bad schema fails again
  at once). The tokenizer (``LLTokenizer``, ~0.3 s) is built on the first
  compile, never at start-up.
- ``GrammarCompiler.check(params)`` waits for that future in the *caller's*
  thread (the api's gRPC handler, ``LLM.generate``), so a bad schema, regex
  or grammar is refused up front as ``InvalidArgument`` naming
  ``sampling_params.structured_outputs.<field>`` (HTTP 400) while the
  engine loop keeps stepping.
- A sequence with structured outputs carries a ``SequenceGrammar``: it waits
  in the waiting queue until the compile is done (``ready``), then gets its
  own ``LLMatcher`` (a copy of the compiled template; ``n > 1`` siblings and
  a preempted sequence keep their own state: a preempted sequence keeps its
  tokens, so its matcher stays valid). ``bitmask`` gives the next token's
  allowed set as i32[W] words (W = ceil(V / 32), bit ``t % 32`` of word
  ``t // 32``); EOS is in it only where the grammar can end, and once the
  grammar is complete (the matcher stopped) EOS is all it allows, so the
  sequence finishes with EOS ("stop", the EOS left out of the text as
  always) on the next step. ``accept`` consumes a sampled token on the host.

The tokenizer's vocabulary and the model's V may differ (padded embedding
tables, or tests' tiny models under a large tokenizer): the matcher is built
over max(V, tokenizer size) tokens and its bitmask cut or padded to V.
JSON is compiled compact (no free whitespace between tokens), so a model
cannot stall in whitespace; ``json_object`` is the schema ``{"type":
"object"}``; ``choice`` a Lark alternation of string literals.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import logging
import pathlib
import re
import threading
from typing import Any

import numpy as np

from jaxserve.structured_outputs import StructuredOutputsParams
from jaxserve.validation import InvalidArgument

logger = logging.getLogger(__name__)

FIELD_PREFIX = "sampling_params.structured_outputs"
_JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(InvalidArgument):
    """A schema, regex or grammar that llguidance refuses (names the field)."""


@dataclasses.dataclass(frozen=True)
class CompiledGrammar:
    """A compiled grammar: a matcher template to copy per sequence.

    Attributes:
      template: an ``llguidance.LLMatcher`` in its initial state (never advanced).
      vocab_size: V, the model's vocabulary (the bitmask's width in tokens).
    """

    template: Any
    vocab_size: int

    def matcher(self) -> Any:
        """A fresh ``LLMatcher`` for one sequence."""
        return self.template.deep_copy()


# A GBNF rule: a line that starts with ``name ::=``. Lark rules are ``name:``, so
# ``::=`` inside a Lark string literal or comment does not make a grammar GBNF.
_GBNF_RULE = re.compile(r"^[ \t]*[A-Za-z_][A-Za-z0-9_-]*[ \t]*::=", re.MULTILINE)


def is_gbnf(text: str) -> bool:
    """True if ``text`` is GBNF (some line starts with a ``name ::=`` rule), else Lark."""
    return _GBNF_RULE.search(text) is not None


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of ``params`` (not yet checked)."""
    from llguidance import LLMatcher  # the engine's dependency; the api never imports it

    kind = params.kind
    if kind == "json":
        schema = json.loads(params.json) if isinstance(params.json, str) else params.json
        if schema is True:  # JSON Schema's "true" (any value) as the schema llguidance takes
            schema = {}
        return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=_JSON_OPTIONS)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in params.choice))
    text = params.grammar
    if is_gbnf(text):  # GBNF (llama.cpp's EBNF): llguidance converts it to Lark
        from llguidance.gbnf_to_lark import gbnf_to_lark

        text = gbnf_to_lark(text)
    return LLMatcher.grammar_from_lark(text)


_PROBE_TOKENS = 16  # first tokens consumed (and rolled back) by first_step_problem


def _llg_error(matcher: Any) -> str:
    """The matcher's error without llguidance's parser-state dump (500 characters at most)."""
    return matcher.get_error().split("\n<state>")[0].strip()[:500]


def first_step_problem(template: Any) -> str | None:
    """Why a grammar that compiled cannot serve a request, found at compile time; None if none.

    llguidance accepts some grammars it cannot run: a self-referential schema
    (``{"$ref": "#"}`` alone) stops at once without accepting any output,
    and a large one (an object with 600 optional properties) overflows the
    parser's row limit on the first token. On a copy of ``template``: the
    first mask is computed, then each of its first ``_PROBE_TOKENS`` allowed
    tokens is consumed and rolled back (a few ms). The step never meets
    what this catches; a limit hit later in an output still aborts it.
    """
    matcher = template.deep_copy()
    words = np.frombuffer(matcher.compute_bitmask(), dtype="<i4")
    if matcher.is_error() or (matcher.is_stopped() and not matcher.is_accepting()):
        return f"the grammar accepts no output ({_llg_error(matcher) or 'it stops at once'})"
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")
    for token in np.flatnonzero(bits)[:_PROBE_TOKENS]:
        if not matcher.consume_token(int(token)) or matcher.is_error():
            return f"llguidance cannot run this grammar: {_llg_error(matcher)}"
        matcher.rollback(1)
    return None


class GrammarCompiler:
    """Compiles ``StructuredOutputsParams`` off the step path; see the module docstring.

    Args:
      tokenizer_dir: the directory holding ``tokenizer.json``; None = the
        demo model's. Without the file every structured request is refused,
        naming the field.
      vocab_size: V.
      eos_token_ids: the ids that end a sequence (allowed where the grammar can end).
      max_workers: compile threads.
      cache_size: compiled grammars kept (LRU).
    """

    def __init__(self, tokenizer_dir: str | pathlib.Path | None, vocab_size: int,
                 eos_token_ids: tuple[int, ...], *, max_workers: int = 2,
                 cache_size: int = 256):
        self.tokenizer_dir = None if tokenizer_dir is None else pathlib.Path(tokenizer_dir)
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.cache_size = cache_size
        self.num_compiles = 0
        self._cache: collections.OrderedDict[tuple[str, str], concurrent.futures.Future] = \
            collections.OrderedDict()
        self._lock = threading.Lock()
        self._tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="grammar-compile")

    def submit(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """A ``Future`` of the ``CompiledGrammar`` (or of a ``GrammarError``); never blocks."""
        key = params.spec
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, params)
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return future

    def check(self, params: StructuredOutputsParams | None, timeout: float | None = None) -> None:
        """Waits (in the caller's thread) until ``params`` compiled.

        Raises:
          GrammarError: (an ``InvalidArgument``) the schema, regex or grammar
            does not compile, naming ``sampling_params.structured_outputs.<field>``.
        """
        if params is not None:
            self.submit(params).result(timeout)

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        from llguidance import LLMatcher

        field = f"{FIELD_PREFIX}.{params.kind}"
        tokenizer = self._llg_tokenizer(field)
        # llguidance raises plain ``Exception`` (a GBNF rule not found) and its
        # own types (``GbnfToLarkError``) besides ValueError: every one of them
        # is the request's grammar at fault, so each becomes a GrammarError.
        try:
            grammar = grammar_text(params)
            matcher = LLMatcher(tokenizer, grammar, log_level=0)
        except Exception as err:  # noqa: BLE001 - llguidance's own error types
            raise GrammarError(field, str(err).strip()[:500] or type(err).__name__) from None
        if matcher.is_error():
            raise GrammarError(field, matcher.get_error().strip()[:500])
        problem = first_step_problem(matcher)
        if problem is not None:
            raise GrammarError(field, problem)
        self.num_compiles += 1
        return CompiledGrammar(matcher, self.vocab_size)

    def _llg_tokenizer(self, field: str):
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = self._load_tokenizer(field)
            return self._tokenizer

    def _load_tokenizer(self, field: str):
        from llguidance import LLTokenizer
        from tokenizers import Tokenizer

        directory = self.tokenizer_dir
        if directory is None:  # the demo model's (built already: the worker serves it)
            from jaxserve.demo_model import resolve_model_path

            directory = resolve_model_path(None)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise GrammarError(FIELD_PREFIX, f"this server has no tokenizer.json "
                                             f"({self.tokenizer_dir}) for structured outputs")
        text = path.read_text(encoding="utf-8")
        size = Tokenizer.from_str(text).get_vocab_size(with_added_tokens=True)
        eos = list(self.eos_token_ids) or None
        try:
            return LLTokenizer(text, n_vocab=max(size, self.vocab_size), eos_token=eos)
        except Exception as err:  # noqa: BLE001 - llguidance's own error types
            raise GrammarError(field, f"the tokenizer cannot serve structured outputs: "
                                      f"{err}") from None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class SequenceGrammar:
    """One sequence's grammar state: its compile future, then its own matcher.

    Attributes:
      params: the request's ``StructuredOutputsParams``.
      future: the compile's ``Future``.
      matcher: the sequence's ``LLMatcher`` once ``ready``; None before.
    """

    __slots__ = ("params", "future", "matcher", "_words")

    def __init__(self, params: StructuredOutputsParams, future: concurrent.futures.Future):
        self.params = params
        self.future = future
        self.matcher = None
        self._words = 0

    @property
    def ready(self) -> bool:
        """True once the compile finished and succeeded (the matcher exists)."""
        if self.matcher is None and self.future.done() and self.future.exception() is None:
            compiled: CompiledGrammar = self.future.result()
            self.matcher = compiled.matcher()
            self._words = -(-compiled.vocab_size // 32)
        return self.matcher is not None

    @property
    def error(self) -> BaseException | None:
        """The compile's error once it failed; None while running or after success."""
        if not self.future.done():
            return None
        return self.future.exception()

    def bitmask(self) -> np.ndarray:
        """i32[W]: the tokens allowed next (see the module docstring)."""
        words = np.frombuffer(self.matcher.compute_bitmask(), dtype="<i4")
        out = np.zeros(self._words, np.int32)
        n = min(len(words), self._words)
        out[:n] = words[:n]
        return out

    def valid_drafts(self, drafts: list[int]) -> int:
        """How many of ``drafts`` (speculative decoding) the grammar allows, in order."""
        return int(self.matcher.validate_tokens(list(drafts)))

    def draft_bitmasks(self, drafts: list[int]) -> np.ndarray:
        """i32[d + 1, W]: the tokens allowed next, then after each draft in turn.

        The drafts must be allowed (``valid_drafts``); the matcher consumes them
        and rolls back, so its state is unchanged.
        """
        masks = [self.bitmask()]
        for token in drafts:
            if not self.matcher.consume_token(int(token)):
                raise ValueError(f"draft {token} breaks the grammar: {self.matcher_error()}")
            masks.append(self.bitmask())
        self.matcher.rollback(len(drafts))
        return np.stack(masks)

    def matcher_error(self) -> str:
        """llguidance's reason the matcher failed ('' if it did not)."""
        return _llg_error(self.matcher) if self.matcher.is_error() else ""

    def accept(self, token_id: int) -> tuple[bool, bool]:
        """Consumes a sampled token: (accepted, stopped).

        ``accepted`` False means the token broke the grammar (it cannot when
        the step applied this sequence's bitmask); ``stopped``: the grammar is
        complete, only EOS may follow.
        """
        ok = self.matcher.consume_token(int(token_id))
        return ok, ok and self.matcher.is_stopped()
