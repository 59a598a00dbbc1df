"""One sequence of a request and its state machine (jax-free).

A request with ``n`` samples becomes ``n`` sequences (``Request`` objects,
vLLM's name, indexed 0 .. n - 1) sharing a ``RequestGroup``. States::

    WAITING ──schedule──▶ RUNNING ──stop / length──▶ FINISHED_STOPPED / FINISHED_LENGTH
       ▲                    │
       └────preempt─────────┘        any state ──abort──▶ FINISHED_ABORTED

A preempted sequence keeps its generated tokens and drops its blocks and
row; when scheduled again it recomputes prompt + output (prefix-cache hits
included) and continues where it stopped.
"""

from __future__ import annotations

import enum

from jaxserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2
    FINISHED_LENGTH = 3
    FINISHED_ABORTED = 4

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class RequestGroup:
    """The ``n`` sequences of one request.

    Sequences 1 .. n - 1 wait (``prompt_ready`` False) until sequence 0 has
    computed the prompt, so that they find its full blocks in the prefix
    cache instead of computing them again.
    """

    __slots__ = ("request_id", "sequences", "prompt_ready", "num_unfinished")

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.sequences: list[Request] = []
        self.prompt_ready = False
        self.num_unfinished = 0


class Request:
    """One sequence: its tokens, progress, blocks and worker row.

    Attributes (tokens are counted in tokens, positions from 0):
      request_id, index: the request and the sample index; ``key`` is both.
      token_ids: prompt then generated tokens (grows by one per sample).
      num_prompt_tokens: the prompt's length.
      num_computed_tokens: tokens whose KV is in the cache (advanced when a
        step is scheduled).
      block_ids: the sequence's KV blocks, in order.
      block_hashes: prefix-cache hashes of its first full blocks.
      cache_salt: the salt of its block hashes; None = ``cacheable`` False
        and no hashing at all.
      row: its worker row, or -1.
      num_blocks_sent: how many of ``block_ids`` the worker's row holds.
      max_tokens: most generated tokens (capped by the model's maximum).
      order: (arrival counter, index); later arrivals are preempted first.
      grammar: the sequence's ``SequenceGrammar`` (structured outputs:
        ``jaxserve.engine.grammar``), or None.
      prompt_logprobs: while the request's prompt logprobs are still to be
        computed and emitted (``SamplingParams.prompt_logprobs`` set; sample 0
        only, the others share its prompt): one entry per prompt position
        1 .. P - 1, None until its step returns it (a ``SampleLogprobs`` of
        that prompt token); None otherwise and once emitted. Such a sequence
        takes no prefix-cache hits (vLLM's rule: the cached prefix has no
        logits).
    """

    __slots__ = (
        "request_id", "index", "key", "group", "sampling_params", "seed", "arrival_time",
        "order", "token_ids", "num_prompt_tokens", "num_computed_tokens", "block_ids",
        "block_hashes", "cacheable", "cache_salt", "row", "num_blocks_sent", "status",
        "max_tokens", "min_tokens", "eos_ids", "stop_ids", "stop_reason", "num_cached_tokens",
        "num_preemptions", "wants_logprobs", "scheduled_before", "grammar", "prompt_logprobs",
        "proposed")

    def __init__(self, request_id: str, index: int, group: RequestGroup,
                 prompt_token_ids: list[int], sampling_params: SamplingParams, seed: int | None,
                 arrival_time: float, order: tuple[int, int], max_model_len: int,
                 eos_token_ids: tuple[int, ...], cacheable: bool, cache_salt: str | None):
        self.request_id = request_id
        self.index = index
        self.key = (request_id, index)
        self.group = group
        self.sampling_params = sampling_params
        self.seed = seed
        self.arrival_time = arrival_time
        self.order = order
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []
        self.cacheable = cacheable
        self.cache_salt = cache_salt
        self.row = -1
        self.num_blocks_sent = 0
        self.status = RequestStatus.WAITING
        room = max_model_len - self.num_prompt_tokens
        mt = sampling_params.max_tokens
        self.max_tokens = room if mt is None else min(mt, room)
        self.min_tokens = sampling_params.min_tokens
        self.eos_ids = frozenset(() if sampling_params.ignore_eos else eos_token_ids)
        self.stop_ids = frozenset(sampling_params.stop_token_ids)
        self.stop_reason: int | None = None
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.wants_logprobs = sampling_params.logprobs is not None
        self.scheduled_before = False
        self.grammar = None
        # The draft model's tokens after the last token (speculative decoding, method
        # draft_model): the next decode step's drafts.
        self.proposed: list[int] = []
        self.prompt_logprobs: list | None = (
            [None] * (self.num_prompt_tokens - 1)
            if sampling_params.prompt_logprobs is not None and index == 0 else None)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    def append_token(self, token_id: int) -> RequestStatus | None:
        """Appends a sampled token; returns the finished status if it ends the sequence.

        Stop conditions (vLLM V1's ``check_stop``, in its order): once
        ``min_tokens`` are generated, an EOS id (unless ``ignore_eos``) or a
        ``stop_token_ids`` id stops ("stop"); then ``max_tokens`` or the
        model's maximum length ends it ("length").
        """
        self.token_ids.append(token_id)
        num_output = len(self.token_ids) - self.num_prompt_tokens
        if num_output >= self.min_tokens:
            if token_id in self.eos_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in self.stop_ids:
                self.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if num_output >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}#{self.index}, {self.status.name}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={len(self.block_ids)}, row={self.row})")
