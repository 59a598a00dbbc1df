"""Per-row sampling parameters as a device pytree, and the host-side builder.

``SamplingMetadata`` holds one row per request for R rows. Every per-request
choice is an array, so one compiled sampler per R serves any mix of rows; the
only static (meta) fields are ``max_num_logprobs`` (the width of the top-N
logprob outputs) and ``logprobs_mode``. The widths of the sparse logit-bias
and banned-id arrays (NB, NE) are shapes, so a server fixes them once.

Shape legend: R rows (requests), V vocab, NB logit-bias entries per row,
NE min-tokens banned ids per row.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.sampling_params import (MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_IDS, SAMPLING_EPS,
                                      SamplingParams)

LogprobsMode = Literal["raw", "processed"]
LOGPROBS_MODES = ("raw", "processed")

_DATA_FIELDS = (
    "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
    "frequency_penalty", "seeds", "seeded", "positions", "prompt_mask", "output_counts",
    "logit_bias_ids", "logit_bias_values", "banned_ids", "ban_active", "num_logprobs")


@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    """Sampling parameters and token statistics for R rows (a pytree).

    Padding rows are greedy with every option off; their outputs are ignored.

    Attributes:
      temperature: f32[R]; below ``SAMPLING_EPS`` (1e-5) the row is greedy.
      top_k: i32[R]; <= 0 or >= V = off.
      top_p: f32[R] in (0, 1]; 1 = off.
      min_p: f32[R] in [0, 1]; 0 = off.
      repetition_penalty: f32[R]; 1 = off.
      presence_penalty: f32[R]; 0 = off.
      frequency_penalty: f32[R]; 0 = off.
      seeds: u32[R, 2], the request seed modulo 2**64 as threefry key data
        (high word, low word), i.e. ``jax.random.PRNGKey(seed)``'s key data
        (with jax_enable_x64 for seeds >= 2**32). Ignored where ``seeded`` is
        False.
      seeded: bool[R]; False rows draw from the server key.
      positions: i32[R], absolute position in the sequence of the token being
        sampled (prompt length + generated tokens so far); a seeded row's draw
        depends only on (seed, position).
      prompt_mask: bool[R, V], token occurs in the prompt.
      output_counts: i32[R, V], times each token was generated so far.
      logit_bias_ids: i32[R, NB], token ids to bias, -1 = padding.
      logit_bias_values: f32[R, NB], added to those tokens' logits.
      banned_ids: i32[R, NE], EOS and stop token ids, -1 = padding.
      ban_active: bool[R], ban ``banned_ids`` this step (fewer than
        ``min_tokens`` tokens generated).
      num_logprobs: i32[R], top logprobs wanted; -1 = no logprobs at all,
        0 = only the sampled token's logprob. At most ``max_num_logprobs``.
      max_num_logprobs: static NL, the width of the top-logprob outputs.
      logprobs_mode: static; "raw" (default, vLLM V1's raw_logprobs): from the
        model's logits before any processing; "processed": from the
        distribution actually sampled (after bias, bans, penalties,
        temperature and filters; greedy rows: temperature 1, no filters).
    """

    temperature: jax.Array  # [R] f32
    top_k: jax.Array  # [R] i32
    top_p: jax.Array  # [R] f32
    min_p: jax.Array  # [R] f32
    repetition_penalty: jax.Array  # [R] f32
    presence_penalty: jax.Array  # [R] f32
    frequency_penalty: jax.Array  # [R] f32
    seeds: jax.Array  # [R, 2] u32
    seeded: jax.Array  # [R] bool
    positions: jax.Array  # [R] i32
    prompt_mask: jax.Array  # [R, V] bool
    output_counts: jax.Array  # [R, V] i32
    logit_bias_ids: jax.Array  # [R, NB] i32
    logit_bias_values: jax.Array  # [R, NB] f32
    banned_ids: jax.Array  # [R, NE] i32
    ban_active: jax.Array  # [R] bool
    num_logprobs: jax.Array  # [R] i32
    max_num_logprobs: int = MAX_LOGPROBS
    logprobs_mode: str = "raw"

    def __post_init__(self) -> None:
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, "
                             f"got {self.logprobs_mode!r}")
        if not 0 <= self.max_num_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_num_logprobs must be in [0, {MAX_LOGPROBS}], "
                             f"got {self.max_num_logprobs}")

    @property
    def num_rows(self) -> int:
        """R."""
        return self.temperature.shape[0]

    @property
    def vocab_size(self) -> int:
        """V."""
        return self.prompt_mask.shape[1]


jax.tree_util.register_dataclass(
    SamplingMetadata, data_fields=list(_DATA_FIELDS),
    meta_fields=["max_num_logprobs", "logprobs_mode"])


def seed_words(seed: int) -> tuple[int, int]:
    """The seed modulo 2**64 as (high, low) uint32 words (threefry key data)."""
    s = seed % (1 << 64)
    return s >> 32, s & 0xFFFFFFFF


def build_sampling_metadata(
    params: Sequence[SamplingParams],
    *,
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    vocab_size: int,
    eos_token_ids: Sequence[int] = (),
    positions: Sequence[int] | None = None,
    num_rows: int | None = None,
    max_num_logprobs: int = MAX_LOGPROBS,
    logprobs_mode: LogprobsMode = "raw",
    logit_bias_width: int = MAX_LOGIT_BIAS,
    banned_width: int = MAX_STOP_IDS,
) -> SamplingMetadata:
    """Builds host (NumPy) metadata for the requests in ``params``.

    Args:
      params: one ``SamplingParams`` per request (row i = params[i]).
      prompt_token_ids: each request's prompt ids.
      output_token_ids: each request's generated ids so far.
      vocab_size: V.
      eos_token_ids: the model's EOS ids (banned with the stop ids while
        ``min_tokens`` is not reached, unless ``ignore_eos``).
      positions: position of the token being sampled per request; default
        len(prompt) + len(output).
      num_rows: R >= len(params) (the bucket); extra rows are padding.
      max_num_logprobs: static NL; must cover every request's ``logprobs``.
      logprobs_mode: "raw" or "processed" (see ``SamplingMetadata``).
      logit_bias_width: NB; banned_width: NE (fixed per server; the defaults are
        ``MAX_LOGIT_BIAS`` and ``MAX_STOP_IDS`` of ``jaxserve.sampling_params``, the
        limits ``jaxserve.validation`` enforces on requests).

    Returns:
      SamplingMetadata with NumPy leaves (``jax.device_put`` it, or pass it
      to ``sample`` directly).

    Raises:
      ValueError: lengths disagree, a token id is outside [0, V), a request
        wants more logprobs than ``max_num_logprobs``, or more logit-bias /
        banned ids than the widths allow.
    """
    n = len(params)
    rows = n if num_rows is None else num_rows
    if rows < n:
        raise ValueError(f"num_rows ({rows}) < number of requests ({n})")
    if len(prompt_token_ids) != n or len(output_token_ids) != n:
        raise ValueError("prompt_token_ids and output_token_ids need one entry per request")
    if positions is not None and len(positions) != n:
        raise ValueError("positions needs one entry per request")
    v = vocab_size
    temperature = np.zeros(rows, np.float32)
    top_k = np.zeros(rows, np.int32)
    top_p = np.ones(rows, np.float32)
    min_p = np.zeros(rows, np.float32)
    rep = np.ones(rows, np.float32)
    presence = np.zeros(rows, np.float32)
    frequency = np.zeros(rows, np.float32)
    seeds = np.zeros((rows, 2), np.uint32)
    seeded = np.zeros(rows, bool)
    pos = np.zeros(rows, np.int32)
    prompt_mask = np.zeros((rows, v), bool)
    output_counts = np.zeros((rows, v), np.int32)
    bias_ids = np.full((rows, logit_bias_width), -1, np.int32)
    bias_values = np.zeros((rows, logit_bias_width), np.float32)
    banned = np.full((rows, banned_width), -1, np.int32)
    ban_active = np.zeros(rows, bool)
    num_logprobs = np.full(rows, -1, np.int32)

    for i, p in enumerate(params):
        prompt = _ids("prompt_token_ids", prompt_token_ids[i], v)
        output = _ids("output_token_ids", output_token_ids[i], v)
        if not p.is_greedy:  # greedy rows keep the filters off, as vLLM does
            temperature[i] = p.temperature
            top_k[i] = p.top_k if 0 < p.top_k < v else 0
            top_p[i], min_p[i] = p.top_p, p.min_p
        rep[i], presence[i], frequency[i] = (
            p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
        if p.seed is not None:
            seeds[i], seeded[i] = seed_words(p.seed), True
        pos[i] = len(prompt) + len(output) if positions is None else positions[i]
        prompt_mask[i, prompt] = True
        np.add.at(output_counts[i], output, 1)
        if p.logit_bias:
            if len(p.logit_bias) > logit_bias_width:
                raise ValueError(f"logit_bias has {len(p.logit_bias)} entries; "
                                 f"at most {logit_bias_width} are supported")
            ids = _ids("logit_bias", list(p.logit_bias), v)
            bias_ids[i, :len(ids)] = ids
            bias_values[i, :len(ids)] = list(p.logit_bias.values())
        stop_ids = _ids("stop_token_ids", p.all_stop_token_ids(eos_token_ids), v)
        if len(stop_ids) > banned_width:
            raise ValueError(f"stop_token_ids: {len(stop_ids)} stop and EOS ids; "
                             f"at most {banned_width} are supported")
        banned[i, :len(stop_ids)] = stop_ids
        ban_active[i] = len(output) < p.min_tokens
        if p.logprobs is not None:
            if p.logprobs > max_num_logprobs:
                raise ValueError(f"logprobs ({p.logprobs}) exceeds max_num_logprobs "
                                 f"({max_num_logprobs})")
            num_logprobs[i] = p.logprobs
    return SamplingMetadata(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        repetition_penalty=rep, presence_penalty=presence, frequency_penalty=frequency,
        seeds=seeds, seeded=seeded, positions=pos, prompt_mask=prompt_mask,
        output_counts=output_counts, logit_bias_ids=bias_ids, logit_bias_values=bias_values,
        banned_ids=banned, ban_active=ban_active, num_logprobs=num_logprobs,
        max_num_logprobs=max_num_logprobs, logprobs_mode=logprobs_mode)


def _ids(name: str, ids: Sequence[int], vocab_size: int) -> np.ndarray:
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        bad = arr[(arr < 0) | (arr >= vocab_size)][0]
        raise ValueError(f"{name}: token id {bad} outside [0, {vocab_size})")
    return arr.astype(np.int32)


@functools.partial(jax.jit, donate_argnames=("output_counts",))
def update_output_counts(output_counts: jax.Array, token_ids: jax.Array) -> jax.Array:
    """Adds one sampled token per row to the per-row output counts.

    Args:
      output_counts: i32[R, V], donated (updated in place).
      token_ids: i32[R]; negative ids (padding rows) are skipped.

    Returns:
      i32[R, V], the updated counts.
    """
    rows, vocab = output_counts.shape
    ids = jnp.where(token_ids < 0, vocab, token_ids)  # [R] i32; vocab -> dropped
    return output_counts.at[jnp.arange(rows), ids].add(1, mode="drop")


def is_greedy(temperature: jax.Array) -> jax.Array:
    """bool[R]: rows decoded greedily (temperature below ``SAMPLING_EPS``)."""
    return temperature < SAMPLING_EPS
