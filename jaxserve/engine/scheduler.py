"""The scheduler: continuous batching in the vLLM V1 style (jax-free).

Contract: ``schedule()`` picks this step's work and returns a
``ScheduledStep``; the engine turns it into a ``StepPlan``
(``plan_builder``), the worker runs it, and ``update()`` feeds the sampled
tokens back and returns one ``EngineCoreOutput`` per sampling sequence.

One step, one token budget (``max_num_batched_tokens``):

1. **Running sequences first**, in arrival order: each gets the tokens it
   still lacks (1 for decode, the rest of its prompt for a chunked prefill),
   capped by the budget. When its blocks cannot be allocated, the *latest
   arrival* among the running sequences is preempted (blocks and row freed,
   back to the front of the waiting queue), until it fits — or until it is
   the one preempted.
2. **Waiting sequences**, first come first served, only in steps without
   preemption: prefix-cache hits first, then as many prompt tokens as the
   budget allows (chunked prefill), while rows and blocks last. Siblings of
   an ``n > 1`` request wait until sequence 0 has computed the prompt, then
   find it in the prefix cache; a sequence with structured outputs waits
   until its grammar compiled (``grammar.py``; one whose compile failed
   finishes "abort"), and its matcher consumes each token in ``update``.

``num_computed_tokens`` advances when a step is scheduled (so the next step
could be planned before this one returns), and blocks that this step fills
enter the prefix cache at once (vLLM V1): a sequence scheduled later in the
same step may hit them, because every layer writes the whole step's keys and
values before any attention reads them, and steps run in order. A sequence
samples when the step computes its last known token.

**Speculative decoding** (``EngineConfig.speculative_config``,
docs/speculative_decoding.md): once the step is chosen, decoding sequences
get draft tokens (``ngram_proposer``, or with a draft model the k tokens
the worker's draft model proposed after the sequence's last token, which
``update`` keeps; every sampling sequence then gets blocks for k tokens
ahead where free, for the draft model's keys and values) while the token budget, the R ladder's
top (one sampling slot per draft) and free blocks last; a draft never runs a
sequence past ``max_tokens`` nor past an EOS or stop token, and a sequence
with structured outputs keeps only the drafts its grammar allows, before any
EOS or stop token (each
draft slot then samples under the mask of the grammar advanced through the
drafts before it: ``EngineCore._token_bitmask``). Drafts are not the sequence's tokens: ``num_computed_tokens`` and the
prefix cache count only what ``update`` accepts, so the KV slots written for
rejected drafts are simply written again later (their blocks stay the
sequence's).
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import dataclasses
import logging

import numpy as np

from jaxserve.engine.block_manager import BlockManager
from jaxserve.engine.config import EngineConfig
from jaxserve.engine.grammar import SequenceGrammar
from jaxserve.engine.messages import EngineCoreOutput, EngineCoreRequest, SampleLogprobs
from jaxserve.engine.ngram_proposer import propose_ngram
from jaxserve.engine.request import FINISH_REASONS, Request, RequestGroup, RequestStatus
from jaxserve.step_plan import PromptLogprobs, StepResult
from jaxserve.validation import InvalidArgument

_ORDER = lambda r: r.order  # noqa: E731
logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class ScheduledStep:
    """One step's schedule, in token order (``SchedulerOutput`` in vLLM).

    ``num_computed`` holds each sequence's cached tokens *before* the step;
    ``new_reqs`` the sequences that start on a row this step (a ``NewRow``);
    ``freed_rows`` the rows released since the previous step;
    ``failed`` the outputs of sequences whose grammar did not compile
    (finished "abort" before ever running); ``drafts`` each sequence's draft
    tokens (speculative decoding; counted in ``num_tokens``), or None when
    the step has none.
    """

    reqs: list[Request] = dataclasses.field(default_factory=list)
    num_computed: list[int] = dataclasses.field(default_factory=list)
    num_tokens: list[int] = dataclasses.field(default_factory=list)
    sample: list[bool] = dataclasses.field(default_factory=list)
    new_reqs: list[Request] = dataclasses.field(default_factory=list)
    freed_rows: list[int] = dataclasses.field(default_factory=list)
    preempted: list[Request] = dataclasses.field(default_factory=list)
    failed: list[EngineCoreOutput] = dataclasses.field(default_factory=list)
    total_tokens: int = 0
    drafts: list[list[int]] | None = None

    def add(self, req: Request, num_tokens: int) -> None:
        c = req.num_computed_tokens
        self.reqs.append(req)
        self.num_computed.append(c)
        self.num_tokens.append(num_tokens)
        req.num_computed_tokens = c + num_tokens
        self.sample.append(c + num_tokens == len(req.token_ids))
        self.total_tokens += num_tokens

    def add_drafts(self, i: int, drafts: list[int]) -> None:
        """Sequence ``i`` (a sampling one) verifies ``drafts`` after its token this step."""
        if self.drafts is None:
            self.drafts = [[] for _ in self.reqs]
        self.drafts[i] = drafts
        self.num_tokens[i] += len(drafts)
        self.total_tokens += len(drafts)

    def num_slots(self, i: int) -> int:
        """Sequence ``i``'s sampling slots: 0, or 1 + its drafts."""
        return self.sample[i] * (1 + (len(self.drafts[i]) if self.drafts else 0))


class Scheduler:
    """Requests, their sequences, the block manager and the worker rows.

    Args:
      config: a resolved ``EngineConfig`` (``num_kv_blocks`` and
        ``max_model_len`` known).
    """

    def __init__(self, config: EngineConfig):
        assert config.cache.num_kv_blocks is not None and config.max_model_len is not None
        self.config = config
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.max_num_batched_tokens = config.scheduler.max_num_batched_tokens
        self.chunked_prefill = config.scheduler.enable_chunked_prefill
        self.max_model_len = config.max_model_len
        self.block_size = config.cache.block_size
        self.block_manager = BlockManager(config.cache.num_kv_blocks, config.cache.block_size,
                                          config.cache.enable_prefix_caching)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # sorted by arrival (Request.order)
        self.groups: dict[str, RequestGroup] = {}
        self.free_rows = list(range(self.max_num_seqs - 1, -1, -1))  # pop() -> lowest row
        self.freed_rows: list[int] = []  # released since the last schedule
        self.num_preemptions = 0
        self.speculative = config.speculative_config
        self.max_num_slots = config.scheduler.request_buckets[-1]  # sampling slots in a step
        self.spec_num_drafts = 0  # sequences whose drafts a step verified
        self.spec_num_draft_tokens = 0  # drafts verified
        self.spec_num_accepted_tokens = 0  # drafts accepted
        self._arrivals = 0
        self.grammar_pending: list[Request] = []  # waiting for their grammar's compile

    # --------------------------------------------------------------- requests
    def add_request(self, request: EngineCoreRequest,
                    grammar: concurrent.futures.Future | None = None) -> None:
        """Queues a request (``n`` sequences) that ``jaxserve.validation`` accepted.

        ``grammar``: the compile of its structured outputs
        (``GrammarCompiler.submit``); its sequences wait until it is done.

        ``EngineCore.add_request`` checks the request against the model's
        limits first; here only what depends on the scheduler's state and
        configuration is checked.

        Raises:
          InvalidArgument: the id of an unfinished request (``request_id``); a
            prompt longer than the step budget without chunked prefill
            (``prompt_token_ids``).
        """
        rid, prompt, sp = request.request_id, request.prompt_token_ids, request.sampling_params
        if rid in self.groups:
            raise InvalidArgument("request_id", f"{rid!r} is already in use")
        if not self.chunked_prefill and len(prompt) > self.max_num_batched_tokens:
            raise InvalidArgument("prompt_token_ids",
                                  f"the prompt has {len(prompt)} tokens, more than "
                                  f"max_num_batched_tokens ({self.max_num_batched_tokens}) "
                                  f"without chunked prefill")
        group = RequestGroup(rid)
        caching = self.block_manager.enable_caching
        # Siblings share the prompt through the cache; with caching off, under
        # a salt no other request can produce.
        salt = request.cache_salt if caching else f"\0group:{rid}:{self._arrivals}"
        for i in range(sp.n):
            seed = None if sp.seed is None else sp.seed + i  # vLLM's child seeds
            req = Request(rid, i, group, prompt, sp, seed, request.arrival_time,
                          (self._arrivals, i), self.max_model_len,
                          self.config.eos_token_ids, caching or sp.n > 1, salt)
            if grammar is not None:
                req.grammar = SequenceGrammar(sp.structured_outputs, grammar)
                self.grammar_pending.append(req)
            group.sequences.append(req)
            self.waiting.append(req)
        group.num_unfinished = sp.n
        self.groups[rid] = group
        self._arrivals += 1

    def abort_requests(self, ids) -> None:
        """Aborts requests (a request id) or single sequences ((request id, index)).

        Unknown or finished ids are ignored, and so are repeats (a sequence
        named twice, or by its id and its pair, ends once). Blocks and rows
        are released now; no output is emitted (the caller knows).
        """
        aborted: dict[int, Request] = {}  # id(req) -> req: a sequence named twice ends once
        for key in ids:
            rid, index = (key, None) if isinstance(key, str) else key
            group = self.groups.get(rid)
            if group is None:
                continue
            for req in group.sequences:
                if (index is None or req.index == index) and not req.is_finished:
                    aborted[id(req)] = req
        if not aborted:
            return
        self.running = [r for r in self.running if id(r) not in aborted]
        self.waiting = collections.deque(r for r in self.waiting if id(r) not in aborted)
        for req in aborted.values():
            self._finish(req, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    # -------------------------------------------------------------- schedule
    def schedule(self) -> ScheduledStep:
        """Chooses this step's sequences and token counts (see the module docstring)."""
        step = ScheduledStep()
        if self.grammar_pending:
            self._poll_grammars(step)
        budget = self.max_num_batched_tokens
        bm, running = self.block_manager, self.running
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = min(len(req.token_ids) - req.num_computed_tokens, budget)
            if n <= 0:  # nothing to compute (its last token is still in flight)
                i += 1
                continue
            total = req.num_computed_tokens + n
            if len(req.block_ids) * self.block_size < total:  # needs new blocks
                while not bm.allocate_slots(req, total):
                    victim = running.pop()  # the latest arrival
                    self._preempt(victim)
                    step.preempted.append(victim)
                    if victim is req:
                        break
                if req.status != RequestStatus.RUNNING:
                    break
            self._add(step, req, n)
            budget -= n
            i += 1

        if not step.preempted:
            self._schedule_waiting(step, budget)
        if self.speculative is not None:
            self._propose_drafts(step)
            if self.speculative.method == "draft_model":
                self._allocate_lookahead(step)
        step.freed_rows, self.freed_rows = self.freed_rows, []
        return step

    def _propose_drafts(self, step: ScheduledStep) -> None:
        """Gives decoding sequences draft tokens (see the module docstring)."""
        spec = self.speculative
        budget = self.max_num_batched_tokens - step.total_tokens
        slots = self.max_num_slots - sum(step.sample)
        for i, req in enumerate(step.reqs):
            if budget <= 0 or slots <= 0:
                return
            if not step.sample[i] or step.num_tokens[i] != 1:
                continue
            room = req.max_tokens - req.num_output_tokens - 1  # the step emits drafts + 1
            k = min(spec.num_speculative_tokens, budget, slots, room)
            if k <= 0:
                continue
            if spec.method == "draft_model":
                drafts = req.proposed[:k]
            else:
                drafts = propose_ngram(np.asarray(req.token_ids, np.int32),
                                       num_speculative_tokens=k,
                                       prompt_lookup_min=spec.prompt_lookup_min,
                                       prompt_lookup_max=spec.prompt_lookup_max).tolist()
            ends = [j for j, t in enumerate(drafts) if t in req.eos_ids or t in req.stop_ids]
            if ends:  # nothing follows a token that may end the sequence, and a grammar
                # never consumes one (update ends the sequence first): it is no draft there
                drafts = drafts[:ends[0] + (req.grammar is None)]
            if req.grammar is not None:
                drafts = drafts[:req.grammar.valid_drafts(drafts)]
            if not drafts or not self.block_manager.allocate_slots(
                    req, req.num_computed_tokens + len(drafts)):
                continue
            step.add_drafts(i, drafts)
            budget -= len(drafts)
            slots -= len(drafts)

    def _allocate_lookahead(self, step: ScheduledStep) -> None:
        """Blocks for k tokens past each sampling sequence's query, where free: the draft
        model writes its proposals' keys and values there in this step (without them
        its proposals past a block's end are worse, never wrong)."""
        k = self.config.max_drafts  # the draft model's proposals per row
        for i, req in enumerate(step.reqs):
            if step.sample[i]:
                drafts = len(step.drafts[i]) if step.drafts else 0
                self.block_manager.allocate_slots(req, min(
                    req.num_computed_tokens + drafts + k, self.max_model_len))

    def _poll_grammars(self, step: ScheduledStep) -> None:
        """Sequences whose grammar compiled may run; those whose compile failed finish."""
        pending = []
        for req in self.grammar_pending:
            if req.is_finished or req.grammar.ready:
                continue
            err = req.grammar.error
            if err is None:
                pending.append(req)
                continue
            logger.info("request %s: structured outputs refused: %s", req.request_id, err)
            self.waiting.remove(req)
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            step.failed.append(EngineCoreOutput(
                req.request_id, req.index, [], finish_reason="abort",
                num_prompt_tokens=req.num_prompt_tokens))
        self.grammar_pending = pending

    def _schedule_waiting(self, step: ScheduledStep, budget: int) -> None:
        bm, waiting, skipped = self.block_manager, self.waiting, []
        while waiting and budget > 0 and self.free_rows:
            req = waiting[0]
            if (req.index > 0 and not req.group.prompt_ready) or (
                    req.grammar is not None and req.grammar.matcher is None):
                skipped.append(waiting.popleft())  # siblings, and grammars still compiling
                continue
            # Prompt logprobs need every prompt token's logits: no cached prefix.
            hits = [] if req.prompt_logprobs is not None else bm.find_cached_blocks(req)
            num_cached = len(hits) * self.block_size
            n = req.num_tokens - num_cached
            if n > budget:
                # Without chunked prefill a prompt waits for a step with room for
                # all of it; a preempted sequence longer than any budget is chunked.
                if not self.chunked_prefill and n <= self.max_num_batched_tokens:
                    break
                n = budget
            if not bm.allocate_slots(req, num_cached + n, hits):
                break
            waiting.popleft()
            if req.cacheable:
                bm.record_lookup(req.num_tokens, num_cached)
            if not req.scheduled_before:
                req.num_cached_tokens = num_cached
                req.scheduled_before = True
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            req.row = self.free_rows.pop()
            req.num_blocks_sent = 0
            bisect.insort(self.running, req, key=_ORDER)
            step.new_reqs.append(req)
            self._add(step, req, n)
            budget -= n
        waiting.extendleft(reversed(skipped))

    def _add(self, step: ScheduledStep, req: Request, n: int) -> None:
        step.add(req, n)
        if req.cacheable:
            self.block_manager.cache_full_blocks(req)
        if req.index == 0 and req.num_computed_tokens >= req.num_prompt_tokens:
            req.group.prompt_ready = True

    def _preempt(self, req: Request) -> None:
        self.block_manager.free(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        self._release_row(req)
        req.num_blocks_sent = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---------------------------------------------------------------- update
    def update(self, step: ScheduledStep, result: StepResult) -> list[EngineCoreOutput]:
        """Appends the sampled tokens, caches full blocks, finishes sequences.

        Returns one output per sequence that sampled (in schedule order).
        """
        outputs: list[EngineCoreOutput] = []
        tokens = result.token_ids.tolist()
        num_slots = [step.num_slots(i) for i in range(len(step.reqs))]
        if len(tokens) != sum(num_slots):
            raise ValueError(f"worker returned {len(tokens)} tokens for "
                             f"{sum(num_slots)} sampling slots")
        if (result.num_accepted is None) != (step.drafts is None):
            raise ValueError("worker returned num_accepted for a step without drafts, or "
                             "none for a step with drafts")
        if result.prompt_logprobs is not None:
            self._store_prompt_logprobs(step, result.prompt_logprobs)
        accepted = iter(() if result.num_accepted is None else result.num_accepted.tolist())
        proposed = iter(() if result.draft_token_ids is None else result.draft_token_ids.tolist())
        j = 0
        finished = False
        for i, req in enumerate(step.reqs):
            if not num_slots[i]:
                continue
            first, j = j, j + num_slots[i]
            num_accepted = next(accepted, 0)
            req.proposed = next(proposed, [])
            if req.status != RequestStatus.RUNNING:  # aborted meanwhile
                continue
            drafts = step.drafts[i] if step.drafts else []
            if drafts:
                self.spec_num_drafts += 1
                self.spec_num_draft_tokens += len(drafts)
                self.spec_num_accepted_tokens += num_accepted
            new, logprobs, status = [], [] if req.wants_logprobs else None, None
            for slot in range(first, first + num_accepted + 1):  # accepted drafts, then one
                status = req.append_token(tokens[slot])
                if status is None and req.grammar is not None:
                    status = self._advance_grammar(req, tokens[slot])
                new.append(tokens[slot])
                if logprobs is not None:
                    logprobs.extend(self._logprobs(result, slot) or ())
                if status is not None:
                    break
            if logprobs == []:
                logprobs = None
            prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, None  # emitted once
            if status is None:
                if len(new) > 1:  # the accepted drafts' KV was written by this step
                    req.num_computed_tokens += len(new) - 1
                    self.block_manager.cache_full_blocks(req)
                outputs.append(EngineCoreOutput(
                    req.request_id, req.index, new, logprobs,
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_cached_tokens=req.num_cached_tokens, prompt_logprobs=prompt_logprobs))
                continue
            self._finish(req, status)
            finished = True
            outputs.append(EngineCoreOutput(
                req.request_id, req.index, new, logprobs,
                finish_reason=FINISH_REASONS[status], stop_reason=req.stop_reason,
                num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=req.num_cached_tokens,
                prompt_logprobs=prompt_logprobs))
        if finished:
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
        return outputs

    @staticmethod
    def _advance_grammar(req: Request, token: int) -> RequestStatus | None:
        """The matcher consumes the token (EOS never reaches it: it ends the sequence).

        A grammar that is complete allows only EOS next, so the sequence ends
        with EOS one step later — as an EOS-ended sequence, its last token is
        left out of the text, and every grammar token is kept.
        """
        accepted, _ = req.grammar.accept(token)
        if not accepted:  # only if the step ignored the sequence's bitmask
            logger.warning("request %s#%d: token %d breaks its grammar; the sequence aborts: %s",
                           req.request_id, req.index, token, req.grammar.matcher_error())
            return RequestStatus.FINISHED_ABORTED
        return None

    @staticmethod
    def _store_prompt_logprobs(step: ScheduledStep, scored: PromptLogprobs) -> None:
        """Files each scored prompt token with its sequence (``Request.prompt_logprobs``)."""
        top_ids, keep = scored.top_token_ids, scored.top_token_ids >= 0
        for e, (i, pos) in enumerate(zip(scored.index.tolist(), scored.position.tolist())):
            entries = step.reqs[i].prompt_logprobs
            if entries is None:  # emitted already
                continue
            if not 0 < pos <= len(entries):
                raise ValueError(f"worker returned a prompt logprob at position {pos} for "
                                 f"{step.reqs[i]!r}, whose prompt has {len(entries) + 1} tokens")
            entries[pos - 1] = SampleLogprobs(
                float(scored.logprob[e]), int(scored.rank[e]),
                tuple(top_ids[e][keep[e]].tolist()),
                tuple(scored.top_logprobs[e][keep[e]].tolist()))

    def _logprobs(self, result: StepResult, j: int) -> list[SampleLogprobs] | None:
        if result.logprob is None:
            return None
        top_ids = result.top_token_ids[j]
        keep = top_ids >= 0
        return [SampleLogprobs(float(result.logprob[j]), int(result.rank[j]),
                               tuple(top_ids[keep].tolist()),
                               tuple(result.top_logprobs[j][keep].tolist()))]

    def _release_row(self, req: Request) -> None:
        self.free_rows.append(req.row)
        self.freed_rows.append(req.row)  # the worker learns it with the next plan
        req.row = -1

    def _finish(self, req: Request, status: RequestStatus) -> None:
        """Marks ``req`` finished and releases its blocks and row (not its running slot)."""
        if req.row >= 0:
            self._release_row(req)
        self.block_manager.free(req)
        req.status = status
        group = req.group
        if req.index == 0:
            group.prompt_ready = True  # siblings no longer wait for it
        group.num_unfinished -= 1
        if group.num_unfinished == 0:
            del self.groups[req.request_id]
