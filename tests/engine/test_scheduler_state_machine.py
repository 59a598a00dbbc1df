"""Hypothesis state machine over the engine core (scheduler + block manager + plans).

Random add / abort / step sequences drive an ``EngineCore`` on a
``FakeWorker`` (which simulates the paged KV cache exactly and asserts the
step-plan contract) with a small KV cache, so prefix sharing, chunked
prefill and preemption all happen. After every rule:

- free + cached + used blocks == total, and each count matches the blocks'
  own state; ref counts >= 0; the null block is never held or queued;
- every block's ref count equals the number of live sequences holding it,
  and a block held by two sequences is shared through the prefix cache
  (it has a hash that maps to it);
- waiting sequences hold no blocks and no row; running ones hold distinct
  rows, and running + free rows partition the worker's rows.

Every finished sequence's tokens and finish reason equal an independent
reference (``expected_completion``: the fake model run alone, no cache).
At teardown the engine runs dry: nothing leaks (all blocks free, all rows
free).
"""

from __future__ import annotations

import collections

import pytest
from hypothesis import event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from jaxserve.engine import CacheConfig, EngineConfig, EngineCore, EngineCoreRequest, SchedulerConfig
from jaxserve.engine.request import RequestStatus
from jaxserve.sampling_params import SamplingParams
from jaxserve.validation import InvalidArgument
from tests.engine.fake_worker import FakeWorker, expected_completion

BLOCK_SIZE = 4
MAX_MODEL_LEN = 48
EOS = (0,)
PREFIXES = [[7] * 9, [5, 6, 7, 8, 9, 10, 11, 12], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]


class EngineMachine(RuleBasedStateMachine):
    configured = False

    @initialize(num_blocks=st.integers(13, 20), budget=st.sampled_from([4, 7, 16, 64]),
          max_num_seqs=st.integers(1, 6), caching=st.booleans(), chunked=st.booleans())
    def configure(self, num_blocks, budget, max_num_seqs, caching, chunked):
        config = EngineConfig(
            max_model_len=MAX_MODEL_LEN,
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                      enable_chunked_prefill=chunked),
            cache=CacheConfig(block_size=BLOCK_SIZE, num_kv_blocks=num_blocks,
                              enable_prefix_caching=caching))
        self.worker = FakeWorker(max_model_len=MAX_MODEL_LEN, eos_token_ids=EOS)
        self.engine = EngineCore(config, self.worker)
        self.sched = self.engine.scheduler
        self.bm = self.sched.block_manager
        self.prompts: dict[str, tuple[list[int], SamplingParams]] = {}
        self.tokens: dict[tuple[str, int], list[int]] = collections.defaultdict(list)
        self.aborted: set[tuple[str, int]] = set()
        self.next_id = 0
        self.configured = True

    @rule(prefix=st.sampled_from(range(len(PREFIXES) + 1)),
          suffix=st.lists(st.integers(1, 63), min_size=0, max_size=14),
          n=st.integers(1, 3), max_tokens=st.integers(1, 30), min_tokens=st.integers(0, 3),
          ignore_eos=st.booleans(), stop=st.lists(st.integers(0, 63), max_size=2),
          salt=st.sampled_from([None, None, "a"]))
    def add(self, prefix, suffix, n, max_tokens, min_tokens, ignore_eos, stop, salt):
        prompt = (PREFIXES[prefix] if prefix < len(PREFIXES) else []) + suffix
        sched = self.sched
        if not prompt or (not sched.chunked_prefill and len(prompt) > sched.max_num_batched_tokens):
            return
        sp = SamplingParams(n=n, max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens),
                            ignore_eos=ignore_eos, stop_token_ids=stop)
        rid = f"r{self.next_id}"
        self.next_id += 1
        if n > sched.max_num_seqs:  # more completions than rows: refused, nothing queued
            with pytest.raises(InvalidArgument, match=r"^sampling_params\.n: "):
                self.engine.add_request(EngineCoreRequest(rid, prompt, sp, cache_salt=salt))
            assert rid not in sched.groups
            return
        self.engine.add_request(EngineCoreRequest(rid, prompt, sp, cache_salt=salt))
        self.prompts[rid] = (prompt, sp)

    @rule(data=st.data(), whole=st.booleans())
    def abort(self, data, whole):
        if not self.sched.groups:
            return
        rid = data.draw(st.sampled_from(sorted(self.sched.groups)))
        n = self.prompts[rid][1].n
        if whole:
            self.engine.abort_requests([rid])
            self.aborted.update((rid, i) for i in range(n))
        else:
            index = data.draw(st.integers(0, n - 1))
            self.engine.abort_requests([(rid, index)])
            self.aborted.add((rid, index))

    @rule(times=st.integers(1, 4))
    def step(self, times):
        for _ in range(times):
            for out in self.engine.step():
                key = (out.request_id, out.index)
                self.tokens[key].extend(out.new_token_ids)
                if out.finished:
                    self._check_finished(key, out)

    def _check_finished(self, key, out):
        assert key not in self.aborted
        prompt, sp = self.prompts[key[0]]
        tokens, reason, stop_reason = expected_completion(prompt, sp, EOS, MAX_MODEL_LEN)
        assert self.tokens[key] == tokens, (key, self.tokens[key], tokens)
        assert (out.finish_reason, out.stop_reason) == (reason, stop_reason)

    # ------------------------------------------------------------ invariants
    @invariant()
    def blocks_are_consistent(self):
        if not self.configured:
            return
        bm = self.bm
        live = [r for g in self.sched.groups.values() for r in g.sequences if not r.is_finished]
        holders = collections.Counter(b for r in live for b in r.block_ids)
        assert 0 not in holders and 0 not in bm.free_queue and bm.ref_cnt[0] == 0
        for b in range(1, bm.num_blocks):
            assert bm.ref_cnt[b] >= 0
            assert bm.ref_cnt[b] == holders.get(b, 0), (b, bm.ref_cnt[b], holders.get(b, 0))
            assert (b in bm.free_queue) == (bm.ref_cnt[b] == 0)
            if holders.get(b, 0) > 1:  # shared only through the prefix cache
                h = bm.hash_of[b]
                assert h is not None and bm.cached[h] == b
        for h, b in bm.cached.items():
            assert bm.hash_of[b] == h
        used = sum(1 for b in range(1, bm.num_blocks) if bm.ref_cnt[b] > 0)
        cached = sum(1 for b in bm.free_queue if bm.hash_of[b] is not None)
        free = len(bm.free_queue) - cached
        stats = self.engine.stats()
        assert (stats.kv_blocks_free, stats.kv_blocks_cached, stats.kv_blocks_used) == (
            free, cached, used)
        assert free + cached + used == stats.kv_blocks_total == bm.num_blocks - 1

    @invariant()
    def rows_and_states_are_consistent(self):
        if not self.configured:
            return
        s = self.sched
        for r in s.waiting:
            assert r.status == RequestStatus.WAITING and not r.block_ids and r.row == -1
        rows = [r.row for r in s.running]
        assert all(r.status == RequestStatus.RUNNING for r in s.running)
        assert len(set(rows)) == len(rows) and -1 not in rows
        assert sorted(rows + s.free_rows) == list(range(s.max_num_seqs))
        assert [r.order for r in s.running] == sorted(r.order for r in s.running)

    def teardown(self):
        if not self.configured:
            return
        for _ in range(2000):
            if not self.engine.has_unfinished_requests():
                break
            self.step(1)
        assert not self.engine.has_unfinished_requests()
        self.blocks_are_consistent()
        stats = self.engine.stats()
        assert stats.kv_blocks_used == 0 and stats.num_running == stats.num_waiting == 0
        assert sorted(self.sched.free_rows) == list(range(self.sched.max_num_seqs))
        event(f"preempted: {stats.num_preemptions > 0}")
        event(f"prefix hits: {stats.prefix_cache_hits > 0}")
        event(f"finished: {len(set(self.tokens) - self.aborted) > 0}")


EngineMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50,
                                           deadline=None)
TestEngineStateMachine = EngineMachine.TestCase
