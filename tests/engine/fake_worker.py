"""Test helper: a jax-free worker that simulates a paged KV cache exactly.

``FakeWorker`` follows the step-plan contract the way the real worker does
(persistent rows updated by diffs, input tokens from its own rows, sampled
tokens appended to its rows) but its "KV cache" holds, in every slot, the
position of the token written there and a 61-bit digest of the whole
sequence up to it: ``kv[p] = mix(kv[p - 1], token[p])``, with ``kv[p - 1]``
read *through the block table*, as attention reads its context. The
"sampled" token is a function of that digest, and so is a prompt token's
"prompt logprob" (rows with ``prompt_logprobs``: the digest of the context
before it, as the real worker scores it from the logits at the position
before). So a wrong block table, a
prefix-cache hit on a block with other content, a stale block, or a token
fed at the wrong position changes the outputs or trips an assertion —
the oracle for the engine tests is the same requests run alone on a big
cache.

It also checks the contract: buckets on the ladders and large enough, rows
freed before reuse, tokens and blocks present for every scheduled position,
no real token written into the null block, and sampling parameters the real
worker's sampler can run (its widths; logit-bias and stop ids in the
vocabulary).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_IDS
from jaxserve.step_plan import Geometry, NewRow, PromptLogprobs, StepPlan, StepResult, WorkerInit

_MASK = (1 << 61) - 1


def _mix(prev: int, token: int, position: int) -> int:
    return ((prev ^ (token + 0x9E3779B97F4A7C15)) * 0x100000001B3 + position) & _MASK


class FakeWorker:
    """A worker whose 'model' is a digest of the context; see the module docstring.

    Args:
      num_kv_blocks: used when the init asks for None.
      max_model_len: the model's maximum length.
      vocab_size: V; token = digest % V.
      eos_token_ids: reported in the geometry.
    """

    def __init__(self, num_kv_blocks: int = 512, max_model_len: int = 256, vocab_size: int = 64,
                 eos_token_ids: tuple[int, ...] = (0,)):
        self.default_blocks = num_kv_blocks
        self.model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.buckets: list[tuple[int, int]] = []
        self.plans: list[StepPlan] = []
        self.keep_plans = False

    def initialize(self, init: WorkerInit) -> Geometry:
        self.init = init
        self.block_size = init.block_size
        self.num_blocks = init.num_kv_blocks or self.default_blocks
        self.max_model_len = min(init.max_model_len or self.model_len, self.model_len)
        self.kv: dict[int, tuple[int, int]] = {}  # slot -> (position, digest)
        self.rows: dict[int, dict] = {}
        return Geometry(self.num_blocks, self.block_size, self.max_model_len, self.vocab_size,
                        self.eos_token_ids)

    def _new_row(self, new: NewRow) -> None:
        assert new.row not in self.rows, f"row {new.row} reused before it was freed"
        assert 0 <= new.row < self.init.max_num_seqs
        p = new.sampling_params
        bias = dict(p.logit_bias or {})
        stop = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
        assert len(bias) <= MAX_LOGIT_BIAS and len(stop) <= MAX_STOP_IDS, "over the sampler widths"
        assert all(0 <= t < self.vocab_size for t in [*bias, *stop]), "an id outside the vocabulary"
        self.rows[new.row] = dict(tokens=new.token_ids.tolist(), blocks=new.block_ids.tolist(),
                                  params=new.sampling_params,
                                  num_prompt=new.num_prompt_tokens)

    def execute(self, plan: StepPlan) -> StepResult:
        if self.keep_plans:
            self.plans.append(plan)
        T, R = plan.num_tokens_bucket, plan.num_reqs_bucket
        assert T in self.init.token_buckets and plan.total_tokens <= T, (T, plan.total_tokens)
        assert (R == 0) == (plan.num_sampled == 0)
        assert R == 0 or (R in self.init.request_buckets and plan.num_sampled <= R)
        self.buckets.append((T, R))
        for row in plan.freed_rows.tolist():
            assert row in self.rows, f"freed row {row} is not in use"
            del self.rows[row]
        for new in plan.new_rows:
            self._new_row(new)
        for row, block in zip(plan.append_rows.tolist(), plan.append_block_ids.tolist()):
            self.rows[row]["blocks"].append(block)
        assert len(set(plan.rows.tolist())) == len(plan.rows), "a row scheduled twice"
        s = self.block_size
        sampled, logprob = [], []
        scored: list[tuple[int, int, float, int]] = []  # (plan index, position, logprob, token)
        for i, (row, c, n, smp) in enumerate(zip(plan.rows.tolist(), plan.num_computed.tolist(),
                                                 plan.num_tokens.tolist(), plan.sample.tolist())):
            state = self.rows[row]
            score = state["params"].prompt_logprobs is not None
            tokens, blocks = state["tokens"], state["blocks"]
            assert n >= 1 and c + n <= len(tokens), (row, c, n, len(tokens))
            assert len(blocks) * s >= c + n, "too few blocks for the step's tokens"
            digest = 0
            for p in range(c, c + n):
                if p > 0:
                    prev_slot = blocks[(p - 1) // s] * s + (p - 1) % s
                    assert prev_slot in self.kv, f"context slot of position {p - 1} never written"
                    pos, digest = self.kv[prev_slot]
                    assert pos == p - 1, f"slot holds position {pos}, expected {p - 1}"
                block = blocks[p // s]
                assert block != 0, "a real token written into the null block"
                digest = _mix(digest, tokens[p], p)
                self.kv[block * s + p % s] = (p, digest)
                if score and p + 1 < state["num_prompt"]:
                    scored.append((i, p + 1, prompt_logprob(digest), tokens[p + 1]))
            if smp:
                assert c + n == len(tokens), "sampling a row that has not computed all its tokens"
                token = (digest >> 11) % self.vocab_size
                tokens.append(token)
                sampled.append(token)
                logprob.append(-((digest >> 3) % 1000) / 100.0)
        wants = any(self.rows[r]["params"].logprobs is not None
                    for r, smp in zip(plan.rows.tolist(), plan.sample.tolist()) if smp)
        k = len(sampled)
        result = StepResult(plan.step_id, np.array(sampled, np.int32))
        if wants:
            top_ids = np.full((k, 2), -1, np.int32)
            top_ids[:, 0] = sampled
            top_lp = np.full((k, 2), -np.inf, np.float32)
            top_lp[:, 0] = logprob
            result = StepResult(plan.step_id, result.token_ids, np.array(logprob, np.float32),
                                np.ones(k, np.int32), top_ids, top_lp)
        if scored:
            index, position, values, ids = (np.array(x) for x in zip(*scored))
            top_ids = np.full((len(scored), 2), -1, np.int32)
            top_ids[:, 0] = ids
            top_lp = np.full((len(scored), 2), -np.inf, np.float32)
            top_lp[:, 0] = values
            result = dataclasses.replace(result, prompt_logprobs=PromptLogprobs(
                index.astype(np.int32), position.astype(np.int32), values.astype(np.float32),
                np.ones(len(scored), np.int32), top_ids, top_lp))
        return result

    def shutdown(self) -> None:
        self.rows.clear()


def prompt_logprob(digest: int) -> float:
    """The fake "logprob" of the token after a context with this digest."""
    return -((digest >> 5) % 1000) / 100.0


def reference_prompt_logprobs(prompt: list[int]) -> list[float]:
    """``FakeWorker``'s prompt logprobs of ``prompt``'s tokens 1 .. P - 1 (the oracle)."""
    out, digest = [], 0
    for p, token in enumerate(prompt[:-1]):
        digest = _mix(digest, token, p)
        out.append(float(np.float32(prompt_logprob(digest))))
    return out


def reference_tokens(prompt: list[int], num_tokens: int, vocab_size: int = 64) -> list[int]:
    """The first ``num_tokens`` tokens ``FakeWorker`` generates for ``prompt`` (no stops).

    Computed directly from the digest chain, with no cache, blocks or engine:
    the oracle for outputs of the engine driving a ``FakeWorker``.
    """
    digest, tokens, out = 0, list(prompt), []
    for p, token in enumerate(tokens):
        digest = _mix(digest, token, p)
    for _ in range(num_tokens):
        token = (digest >> 11) % vocab_size
        out.append(token)
        digest = _mix(digest, token, len(tokens))
        tokens.append(token)
    return out


def expected_completion(prompt: list[int], params, eos_token_ids: tuple[int, ...],
                        max_model_len: int, vocab_size: int = 64) -> tuple[list[int], str, int | None]:
    """(token ids, finish reason, stop reason) of a sequence under ``FakeWorker``.

    Applies the engine's stop rules independently: after ``min_tokens``, EOS
    (unless ``ignore_eos``) then ``stop_token_ids`` stop; ``max_tokens`` and
    ``max_model_len`` end with "length".
    """
    limit = max_model_len - len(prompt)
    if params.max_tokens is not None:
        limit = min(limit, params.max_tokens)
    tokens = reference_tokens(prompt, limit, vocab_size)
    for i, token in enumerate(tokens):
        if i + 1 >= params.min_tokens:
            if not params.ignore_eos and token in eos_token_ids:
                return tokens[:i + 1], "stop", None
            if token in params.stop_token_ids:
                return tokens[:i + 1], "stop", token
    return tokens, "length", None
