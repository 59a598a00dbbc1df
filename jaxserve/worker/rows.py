"""The worker's host mirror of its persistent rows, updated by step-plan diffs.

One row per running sequence for its lifetime (docs/step_plan.md). The
device holds what a step reads (``device_state.DeviceRows``: block table,
sampling parameters, last sampled token); this host mirror holds what the
worker needs to *plan* a step without asking the device:

- the tokens the host knows (the prompt, and for a resumed sequence the
  tokens generated before: everything ``NewRow.token_ids`` carried), so a
  prefill chunk's input ids travel in the step's packed buffer;
- how many tokens each row has (``num_tokens``), counting the tokens of
  steps already dispatched whose values are still on the device — a decode
  row's input is then the device's own last sampled token;
- the block table and the sampling parameters, to validate plans, choose
  the sampler variant, and resynchronise a device row when needed.

Row ``M = max_num_seqs`` is a permanent *padding row* with neutral
parameters: gathering ``params[rows_padded_with_M]`` gives padded sampler
inputs directly.

Shape legend: M rows, L max model length, MB = ceil(L / S) blocks per row,
V vocab, NB logit-bias width, NE banned-ids width.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.step_plan import NewRow
from jaxserve.worker.sampler import SamplerVariant, build_sampling_metadata, covering_variant
from jaxserve.worker.sampler.variants import STAGES, required_stages

# Per-row sampler fields copied from build_sampling_metadata (one row at a time).
PARAM_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                "presence_penalty", "frequency_penalty", "seeds", "seeded", "logit_bias_ids",
                "logit_bias_values", "banned_ids", "num_logprobs")


class RowState:
    """Host arrays of all rows; see the module docstring.

    Args:
      max_num_seqs: M.
      max_model_len: L.
      block_size: S.
      vocab_size: V.
      eos_token_ids: the model's EOS ids (banned until ``min_tokens``).
    """

    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int, vocab_size: int,
                 eos_token_ids: tuple[int, ...]):
        m, self.max_model_len = max_num_seqs, max_model_len
        self.max_num_seqs, self.block_size, self.vocab_size = m, block_size, vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_blocks = -(-max_model_len // block_size)  # MB
        self.in_use = np.zeros(m, bool)  # [M]
        self.token_ids = np.zeros((m, max_model_len), np.int32)  # [M, L] host-known tokens
        self.num_known = np.zeros(m, np.int32)  # [M] tokens in token_ids
        self.num_tokens = np.zeros(m, np.int32)  # [M] known + sampled by dispatched steps
        self.num_prompt_tokens = np.zeros(m + 1, np.int32)  # [M + 1]
        self.min_tokens = np.zeros(m + 1, np.int32)  # [M + 1]
        self.block_table = np.zeros((m + 1, self.max_blocks), np.int32)  # [M + 1, MB] null-padded
        self.num_blocks = np.zeros(m, np.int32)  # [M]
        self.has_penalty = np.zeros(m + 1, bool)  # [M + 1]
        self.has_banned = np.zeros(m + 1, bool)  # [M + 1] EOS / stop ids to ban for min_tokens
        self.stages = np.zeros((m + 1, len(STAGES)), bool)  # [M + 1, stages] the row needs
        self.prompt_logprobs = np.full(m, -1, np.int32)  # [M] N of prompt logprobs, -1 none
        pad = build_sampling_metadata([], prompt_token_ids=[], output_token_ids=[],
                                      vocab_size=vocab_size, num_rows=1)
        # [M + 1, ...] per field; row M stays the neutral padding row.
        self.params = {f: np.repeat(getattr(pad, f), m + 1, axis=0) for f in PARAM_FIELDS}

    def free(self, rows: np.ndarray) -> None:
        """Releases rows (i32[F]).

        Raises:
          ValueError: a row that is not in use.
        """
        if rows.size and not self.in_use[rows].all():
            raise ValueError(f"freeing rows not in use: {rows[~self.in_use[rows]].tolist()}")
        self.in_use[rows] = False
        self.num_known[rows] = 0
        self.num_tokens[rows] = 0
        self.num_blocks[rows] = 0
        self.block_table[rows] = 0
        self.prompt_logprobs[rows] = -1

    def add(self, new: NewRow):
        """Fills a new row; returns its one-row SamplingMetadata (NumPy) for penalty state.

        Raises:
          ValueError: the row is in use or out of range, too many tokens or
            blocks, a token id outside the vocabulary, or invalid parameters.
        """
        r, p = new.row, len(new.token_ids)
        if not 0 <= r < self.max_num_seqs or self.in_use[r]:
            raise ValueError(f"new row {r} is out of range or in use")
        if p > self.max_model_len or len(new.block_ids) > self.max_blocks:
            raise ValueError(f"row {r}: {p} tokens / {len(new.block_ids)} blocks exceed "
                             f"{self.max_model_len} / {self.max_blocks}")
        sp = new.sampling_params
        if new.seed != sp.seed or sp.n != 1:
            sp = dataclasses.replace(sp, seed=new.seed, n=1)
        ids = new.token_ids
        meta = build_sampling_metadata(
            [sp], prompt_token_ids=[ids[:new.num_prompt_tokens]],
            output_token_ids=[ids[new.num_prompt_tokens:]], vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids)  # widths: MAX_LOGIT_BIAS, MAX_STOP_IDS
        for f in PARAM_FIELDS:
            self.params[f][r] = getattr(meta, f)[0]
        self.in_use[r] = True
        self.token_ids[r, :p] = ids
        self.num_known[r] = self.num_tokens[r] = p
        self.num_prompt_tokens[r] = new.num_prompt_tokens
        self.min_tokens[r] = sp.min_tokens
        self.prompt_logprobs[r] = -1 if sp.prompt_logprobs is None else sp.prompt_logprobs
        self.has_penalty[r] = (sp.repetition_penalty != 1.0 or sp.presence_penalty != 0.0
                               or sp.frequency_penalty != 0.0)
        self.has_banned[r] = bool((meta.banned_ids[0] >= 0).any())
        needed = required_stages(
            meta.temperature, meta.top_k, meta.top_p, meta.min_p, meta.repetition_penalty,
            meta.presence_penalty, meta.frequency_penalty, meta.logit_bias_ids,
            np.zeros(1, bool), meta.num_logprobs, self.vocab_size)
        self.stages[r] = [getattr(needed, stage) for stage in STAGES]
        nb = len(new.block_ids)
        self.block_table[r, :nb] = new.block_ids
        self.block_table[r, nb:] = 0
        self.num_blocks[r] = nb
        return meta

    def append_blocks(self, rows: np.ndarray, block_ids: np.ndarray) -> np.ndarray:
        """Appends blocks (in order) to rows; i32[A] each.

        Returns:
          i32[A], each block's index in its row's block table.

        Raises:
          ValueError: a row not in use, or a row's table would overflow.
        """
        index = np.empty(len(rows), np.int32)
        for i, (r, b) in enumerate(zip(rows.tolist(), block_ids.tolist())):
            n = self.num_blocks[r]
            if not self.in_use[r] or n >= self.max_blocks:
                raise ValueError(f"cannot append block {b} to row {r}")
            self.block_table[r, n] = b
            index[i] = n
            self.num_blocks[r] = n + 1
        return index

    def sampler_variant(self, rows: np.ndarray) -> SamplerVariant:
        """The cheapest sampler variant exact for these sampling rows (i32[s]).

        Each row's stages are found once, when it is added; only the
        min-tokens ban changes from step to step (it is active while fewer
        than ``min_tokens`` tokens were generated).
        """
        needed = dict(zip(STAGES, self.stages[rows].any(axis=0).tolist()))
        banning = (self.num_tokens[rows] - self.num_prompt_tokens[rows] < self.min_tokens[rows])
        needed["processing"] |= bool((banning & self.has_banned[rows]).any())
        return covering_variant(SamplerVariant(**needed))

    def count_sampled(self, rows: np.ndarray) -> None:
        """Counts one token (still on the device) for each sampling row (i32[s]).

        A row at ``max_model_len`` keeps its length (its token is never an input).
        """
        n = self.num_tokens[rows]
        self.num_tokens[rows] = np.minimum(n + 1, self.max_model_len)

    def count_accepted(self, rows: np.ndarray, num_accepted: np.ndarray) -> None:
        """Counts the draft tokens each of these sampling rows accepted (i32[k] each).

        ``count_sampled`` counted the token after them when the step was
        dispatched; their values are the plan's drafts, whose KV the step wrote.
        """
        self.num_tokens[rows] = np.minimum(self.num_tokens[rows] + num_accepted,
                                           self.max_model_len)
