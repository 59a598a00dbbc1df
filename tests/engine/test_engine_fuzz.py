"""Fuzzing ``EngineCore`` with hypothesis: random requests, parameters and aborts never break it.

Each example builds an ``EngineCore`` on the jax-free ``FakeWorker``
(tests/engine/fake_worker.py; it asserts the step-plan contract) with a
random configuration (sync or async scheduling, prefix caching and chunked
prefill on or off, a small KV cache so preemption happens), then runs a
random list of operations:

- **add**: a prompt that may be empty, over ``max_model_len``, over the
  step budget, or hold ids outside the vocabulary; ``SamplingParams`` drawn
  within and beyond every field's range (NaN and infinities too), with
  request ids that may repeat, and valid values near and over the
  sampler's widths (``MAX_STOP_IDS``, ``MAX_LOGIT_BIAS``; the fake worker
  asserts them as the real one refuses them). ``SamplingParams`` itself may refuse the
  values (``ValueError``: the caller's contract, nothing reaches the
  engine); ``add_request`` may refuse the request only with ``ValueError``,
  and then leaves the engine as it was;
- **abort**: a list mixing request ids and (id, index) pairs, live,
  finished, unknown and repeated ones;
- **step**: one to four steps.

After every operation: free + cached + used blocks == total (from
``stats()`` and from the blocks' own ref counts); no output names a
completion that was aborted or had finished, or a request never added.
At the end the engine runs dry within a bounded number of steps and holds
nothing: no request, every block free, every row free.
"""

from __future__ import annotations

import math

from hypothesis import HealthCheck, event, given, settings, strategies as st

from jaxserve.engine import CacheConfig, EngineConfig, EngineCore, EngineCoreRequest, SchedulerConfig
from jaxserve.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_IDS, SamplingParams
from tests.engine.fake_worker import FakeWorker

VOCAB = 64
MAX_MODEL_LEN = 40
BLOCK_SIZE = 4
EOS = (0,)
SPECIAL_FLOATS = [math.nan, math.inf, -math.inf]


def _floats(low: float, high: float) -> st.SearchStrategy[float]:
    return st.one_of(st.floats(low, high), st.sampled_from(SPECIAL_FLOATS))


# field -> (values within its range, values within and beyond it)
_FIELDS = {
    "n": (st.integers(1, 3), st.integers(-1, 4)),
    "temperature": (st.floats(0.0, 2.0), _floats(-1.0, 3.0)),
    "top_p": (st.floats(0.01, 1.0), _floats(-0.5, 1.5)),
    "top_k": (st.integers(-1, VOCAB), st.integers(-3, 2 * VOCAB)),
    "min_p": (st.floats(0.0, 1.0), _floats(-0.5, 1.5)),
    "presence_penalty": (st.floats(-2.0, 2.0), _floats(-3.0, 3.0)),
    "frequency_penalty": (st.floats(-2.0, 2.0), _floats(-3.0, 3.0)),
    "repetition_penalty": (st.floats(0.1, 2.0), _floats(-1.0, 3.0)),
    "seed": (st.one_of(st.none(), st.integers(0, 2**63)),
             st.one_of(st.none(), st.integers(-2**70, 2**70))),
    "stop_token_ids": (st.lists(st.integers(0, VOCAB - 1), max_size=4),
                       st.lists(st.integers(-3, VOCAB + 3), max_size=20)),
    "ignore_eos": (st.booleans(), st.booleans()),
    "max_tokens": (st.one_of(st.none(), st.integers(1, 2 * MAX_MODEL_LEN)),
                   st.one_of(st.none(), st.integers(-2, 2 * MAX_MODEL_LEN))),
    "min_tokens": (st.integers(0, 2), st.integers(-1, MAX_MODEL_LEN)),
    "logprobs": (st.one_of(st.none(), st.integers(0, 20)),
                 st.one_of(st.none(), st.integers(-1, 25))),
    "prompt_logprobs": (st.none(), st.one_of(st.none(), st.integers(-1, 2))),
    "logit_bias": (st.one_of(st.none(), st.dictionaries(st.integers(0, VOCAB - 1),
                                                        st.floats(-100.0, 100.0), max_size=4)),
                   st.one_of(st.none(), st.dictionaries(st.integers(-3, VOCAB + 3),
                                                        _floats(-200.0, 200.0), max_size=70))),
}
# Each field sometimes left out (its default); three in four examples' values in range.
_IN_RANGE = st.fixed_dictionaries({}, optional={k: v[0] for k, v in _FIELDS.items()})
_BEYOND = st.fixed_dictionaries({}, optional={k: v[1] for k, v in _FIELDS.items()})
# Valid parameters near and over the sampler's widths, ids at the vocabulary's edge.
_SAMPLER_EDGE = st.fixed_dictionaries({
    "stop_token_ids": st.lists(st.integers(0, VOCAB + 3), max_size=MAX_STOP_IDS + 3),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB + 3), st.floats(-100.0, 100.0),
                                  max_size=MAX_LOGIT_BIAS + 3),
}, optional={k: v[0] for k, v in _FIELDS.items() if k not in ("stop_token_ids", "logit_bias")})
PARAMS = st.one_of(_IN_RANGE, _IN_RANGE, _IN_RANGE, _BEYOND, _SAMPLER_EDGE)
_FITTING = st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=MAX_MODEL_LEN // 2)
PROMPTS = st.one_of(
    _FITTING, _FITTING, _FITTING,
    st.sampled_from([[7] * 9, [7] * 9 + [1, 2], [3, 1, 4, 1, 5, 9, 2, 6]]),  # shared prefixes
    st.lists(st.integers(1, VOCAB - 1), min_size=0, max_size=MAX_MODEL_LEN + 4),  # empty, long
    st.lists(st.integers(-2, VOCAB + 2), min_size=1, max_size=8),  # ids outside the vocabulary
)
IDS = st.sampled_from(["r0", "r1", "r2", "r3"])
_TARGET_LISTS = st.lists(st.one_of(IDS, st.tuples(IDS, st.integers(-1, 3))), max_size=4)
TARGETS = st.one_of(_TARGET_LISTS, _TARGET_LISTS.map(lambda t: t + t))  # repeats too
_ADD = st.tuples(st.just("add"), IDS, PROMPTS, PARAMS)
OPS = st.lists(st.one_of(
    _ADD, _ADD,
    st.tuples(st.just("abort"), TARGETS),
    st.tuples(st.just("step"), st.integers(1, 4)),
), min_size=4, max_size=30)
CONFIGS = st.fixed_dictionaries({
    "async_scheduling": st.booleans(),
    "caching": st.booleans(),
    "chunked": st.booleans(),
    "num_blocks": st.integers(MAX_MODEL_LEN // BLOCK_SIZE + 1, 24),
    "budget": st.sampled_from([4, 7, 16, 64]),
    "max_num_seqs": st.integers(1, 6),
})


class _Harness:
    """An engine core plus the bookkeeping the checks need."""

    def __init__(self, cfg: dict) -> None:
        config = EngineConfig(
            max_model_len=MAX_MODEL_LEN, async_scheduling=cfg["async_scheduling"],
            scheduler=SchedulerConfig(max_num_seqs=cfg["max_num_seqs"],
                                      max_num_batched_tokens=cfg["budget"],
                                      enable_chunked_prefill=cfg["chunked"]),
            cache=CacheConfig(block_size=BLOCK_SIZE, num_kv_blocks=cfg["num_blocks"],
                              enable_prefix_caching=cfg["caching"]))
        self.engine = EngineCore(config, FakeWorker(max_model_len=MAX_MODEL_LEN,
                                                    vocab_size=VOCAB, eos_token_ids=EOS))
        self.live: dict[str, set[int]] = {}  # request id -> indices that may still emit
        self.added = self.refused = self.outputs = 0

    def add(self, rid: str, prompt: list[int], kwargs: dict) -> None:
        try:
            params = SamplingParams(**kwargs)
        except ValueError:
            return  # the parameters' own contract: nothing reaches the engine
        before = self._snapshot()
        try:
            self.engine.add_request(EngineCoreRequest(rid, prompt, params))
        except ValueError:
            assert self._snapshot() == before, "a refused request changed the engine"
            self.refused += 1
            return
        self.live[rid] = set(range(params.n))
        self.added += 1

    def abort(self, targets: list) -> None:
        self.engine.abort_requests(targets)
        for t in targets:
            if isinstance(t, str):
                self.live.pop(t, None)
            elif t[0] in self.live:
                self.live[t[0]].discard(t[1])
                if not self.live[t[0]]:
                    del self.live[t[0]]

    def step(self) -> None:
        for out in self.engine.step():
            self.outputs += 1
            assert out.index in self.live.get(out.request_id, ()), (
                f"output for {out.request_id}#{out.index}, which is finished, aborted or unknown")
            if out.finished:
                self.live[out.request_id].discard(out.index)
        for rid in [r for r, idx in self.live.items() if not idx]:
            del self.live[rid]

    def _snapshot(self) -> tuple:
        s = self.engine.stats()
        return (s.num_waiting, s.num_running, s.kv_blocks_used, s.kv_blocks_free,
                s.kv_blocks_cached, tuple(sorted(self.engine.scheduler.groups)))

    def check_books(self) -> None:
        """The engine's unfinished sequences are exactly those the outputs left unfinished."""
        sched = self.engine.scheduler
        engine_live = {rid: {r.index for r in g.sequences if not r.is_finished}
                       for rid, g in sched.groups.items()}
        assert engine_live == self.live
        for rid, group in sched.groups.items():
            assert group.num_unfinished == len(engine_live[rid]) > 0
        queued = [r for r in sched.running] + list(sched.waiting)
        assert all(not r.is_finished and r.request_id in sched.groups for r in queued)
        assert len(queued) == sum(len(v) for v in engine_live.values())

    def check_blocks(self) -> None:
        self.check_books()
        stats = self.engine.stats()
        bm = self.engine.scheduler.block_manager
        assert stats.kv_blocks_free + stats.kv_blocks_cached + stats.kv_blocks_used \
            == stats.kv_blocks_total == bm.num_blocks - 1
        assert stats.kv_blocks_used == sum(1 for b in range(1, bm.num_blocks) if bm.ref_cnt[b] > 0)
        assert min(bm.ref_cnt) >= 0 and bm.ref_cnt[0] == 0

    def run_dry(self, max_steps: int = 5000) -> None:
        for _ in range(max_steps):
            if not self.engine.has_unfinished_requests():
                break
            self.step()
            self.check_blocks()
        assert not self.engine.has_unfinished_requests(), "the engine did not run dry"
        self.step()  # async scheduling: a step still in flight is drained
        stats = self.engine.stats()
        assert stats.num_waiting == stats.num_running == stats.kv_blocks_used == 0
        sched = self.engine.scheduler
        assert sorted(sched.free_rows) == list(range(sched.max_num_seqs))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=CONFIGS, ops=OPS)
def test_engine_core_survives_random_requests_and_aborts(cfg, ops):
    h = _Harness(cfg)
    for op in ops:
        if op[0] == "add":
            h.add(*op[1:])
        elif op[0] == "abort":
            h.abort(op[1])
        else:
            for _ in range(op[1]):
                h.step()
                h.check_blocks()
        h.check_blocks()
    h.run_dry()
    h.engine.shutdown()
    event(f"requests added: {min(h.added, 3)}+" if h.added >= 3 else f"requests added: {h.added}")
    event(f"refused by add_request: {h.refused > 0}")
    event(f"preempted: {h.engine.stats().num_preemptions > 0}")
