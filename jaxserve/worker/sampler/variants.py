"""Sampler variants: which stages one compiled sampler contains, chosen by the host.

The sampler has no data-dependent control flow (on a GPU a ``lax.cond`` or
``while_loop`` copies its predicate to the host and waits, stalling the
dispatched step). Instead the server compiles a few static variants per R and
the host picks one per step from the sampling parameters alone
(``choose_variant``, NumPy only). Inside a variant every stage it includes
runs for all rows; rows that do not need a stage ignore its result.

A variant may leave a stage out only when the parameters prove that no row
needs it. Stages and the rows that need them (``T`` = temperature, KC =
``num_candidates`` capped at V, top-k on = 0 < top_k < V):

- ``random``: temperature and the Gumbel draws (the full-vocabulary two-level
  draw always runs): any row with T >= ``SAMPLING_EPS``. Without it every row
  is an argmax.
- ``filters``: the KC candidates (``lax.top_k``), min-p, top-k <= KC, and
  top-p from the candidates: a random row with top-k on, top_p < 1 or
  min_p > 0.
- ``search``: the exact threshold searches past the candidates (top-k > KC,
  or a nucleus wider than the candidates): a random row with top-k > KC on,
  or with top_p < 1 and no top-k <= KC on (whether the nucleus fits in the
  candidates depends on the logits, which the host does not see). Never
  needed when KC >= V.
- ``processing``: logit bias, min-tokens bans and penalties: any row (greedy
  rows too) with a logit-bias id, an active ban, or a penalty switched on.
- ``logprobs``: the logprob outputs: any row with num_logprobs >= 0. Without
  it the outputs hold the no-logprobs values (NaN, -1, -inf, -1).
- ``mask``: the structured-output token bitmask (``bitmask.py``), applied to
  the raw logits before every other stage: any step with a constrained row
  (the host knows: the plan carries a bitmask). Only the ``MASKED_VARIANTS``
  have it.

The variants chosen from sampling parameters (``SAMPLER_VARIANTS``, cheapest
first): GREEDY (argmax only), SAMPLED (temperature, filters from the
candidates, Gumbel draws), PROCESSED (SAMPLED + processing + logprobs) and
FULL (PROCESSED + search), which covers every unconstrained row. A step with
a constrained row runs a masked variant (``masked_variant``): MASKED_SAMPLED
(SAMPLED + mask) when its rows need no more than SAMPLED — plain
temperature sampling or greedy, what structured outputs and tool calls
mostly ask for — else MASKED (FULL + mask), so unconstrained steps pay
nothing for the mask and constrained ones pay for the searches only when a
row needs them. The server compiles ``COMPILED_VARIANTS`` (all six).
The searches (64 passes over [R, V]) cost far more than every other stage
(XLA on a 2-core CPU, R = 64, V = 49,152: PROCESSED ~27 ms per call, FULL
~150-180 ms), so only batches with a row that may need them pay for them.

A row's results do not depend on the variant, as long as the variant covers
it: every stage computes the same values for it in every variant that
includes the stage, and the random draws come from the row's own keys and
streams.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.sampling_params import SAMPLING_EPS
from jaxserve.worker.sampler.top_k_top_p import NUM_CANDIDATES

STAGES = ("random", "filters", "search", "processing", "logprobs", "mask")


@dataclasses.dataclass(frozen=True, slots=True)
class SamplerVariant:
    """The stages one compiled sampler includes (static, hashable).

    Attributes (see the module docstring for which rows need each):
      random: temperature sampling; False = argmax of every row.
      filters: min-p, top-k <= KC and top-p from the top-KC candidates.
      search: the exact threshold searches past the candidates.
      processing: logit bias, min-tokens bans, penalties.
      logprobs: the logprob outputs.
      mask: the structured-output token bitmask, before every other stage.

    Raises:
      ValueError: ``search`` without ``filters``, or ``filters`` without
        ``random``.
    """

    random: bool = True
    filters: bool = True
    search: bool = True
    processing: bool = True
    logprobs: bool = True
    mask: bool = False

    def __post_init__(self) -> None:
        if self.search and not self.filters:
            raise ValueError(f"search needs filters: {self}")
        if self.filters and not self.random:
            raise ValueError(f"filters need random: {self}")

    def covers(self, needed: SamplerVariant) -> bool:
        """True when this variant includes every stage that ``needed`` does."""
        return all(getattr(self, s) or not getattr(needed, s) for s in STAGES)


# The variants chosen from sampling parameters, cheapest first; FULL, the last,
# covers every unconstrained row. PROCESSED is everything but the searches
# (see the module docstring). MASKED covers every row, constrained ones too.
GREEDY = SamplerVariant(random=False, filters=False, search=False, processing=False,
                        logprobs=False)  # argmax only
SAMPLED = SamplerVariant(search=False, processing=False, logprobs=False)
PROCESSED = SamplerVariant(search=False)
FULL = SamplerVariant()
SAMPLER_VARIANTS = (GREEDY, SAMPLED, PROCESSED, FULL)
# The variants of steps with a constrained row, cheapest first; MASKED covers every row.
MASKED_SAMPLED = SamplerVariant(search=False, processing=False, logprobs=False, mask=True)
MASKED = SamplerVariant(mask=True)
MASKED_VARIANTS = (MASKED_SAMPLED, MASKED)
# What a server compiles per R; covering_variant's order (a masked variant covers
# an unconstrained row too, but FULL comes first).
COMPILED_VARIANTS = (*SAMPLER_VARIANTS, *MASKED_VARIANTS)


def required_stages(temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
                    min_p: np.ndarray, repetition_penalty: np.ndarray,
                    presence_penalty: np.ndarray, frequency_penalty: np.ndarray,
                    logit_bias_ids: np.ndarray, ban_active: np.ndarray,
                    num_logprobs: np.ndarray, vocab_size: int, *,
                    num_candidates: int = NUM_CANDIDATES) -> SamplerVariant:
    """The smallest set of stages that is exact for the given rows (host, NumPy).

    Args: as ``choose_variant``.

    Returns:
      SamplerVariant whose flags are the stages some row needs.
    """
    # Compared in f32, as the device compares SamplingMetadata's f32 fields.
    temperature, top_p, min_p = (np.asarray(a, np.float32) for a in (temperature, top_p, min_p))
    top_k = np.asarray(top_k)
    kc = min(num_candidates, vocab_size)
    random_rows = temperature >= np.float32(SAMPLING_EPS)  # [s] bool
    k_on = (top_k > 0) & (top_k < vocab_size)  # [s] bool
    k_inside = k_on & (top_k <= kc)  # the kept set ends at or above the KC-th candidate
    filtered = random_rows & (k_on | (top_p < 1.0) | (min_p > 0.0))
    past_candidates = (k_on & (top_k > kc)) | ((top_p < 1.0) & ~k_inside & (kc < vocab_size))
    penalized = ((np.asarray(repetition_penalty, np.float32) != 1.0)
                 | (np.asarray(presence_penalty, np.float32) != 0.0)
                 | (np.asarray(frequency_penalty, np.float32) != 0.0))
    return SamplerVariant(
        random=bool(np.any(random_rows)),
        filters=bool(np.any(filtered)),
        search=bool(np.any(random_rows & past_candidates)),
        processing=bool(np.any(penalized) or np.any(np.asarray(logit_bias_ids) >= 0)
                        or np.any(ban_active)),
        logprobs=bool(np.any(np.asarray(num_logprobs) >= 0)))


def choose_variant(temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
                   min_p: np.ndarray, repetition_penalty: np.ndarray,
                   presence_penalty: np.ndarray, frequency_penalty: np.ndarray,
                   logit_bias_ids: np.ndarray, ban_active: np.ndarray,
                   num_logprobs: np.ndarray, vocab_size: int, *,
                   num_candidates: int = NUM_CANDIDATES) -> SamplerVariant:
    """The cheapest variant in ``SAMPLER_VARIANTS`` that is exact for these rows.

    Host-side (NumPy, no device work). Pass the rows that sample this step
    (padding rows are greedy with every option off and need nothing).

    Args:
      temperature, top_p, min_p, repetition_penalty, presence_penalty,
        frequency_penalty: f32[s] (``SamplingMetadata``'s conventions).
      top_k: i32[s]; <= 0 or >= V = off.
      logit_bias_ids: i32[s, NB], -1 = padding.
      ban_active: bool[s] (an active row counts as banning, whatever its ids).
      num_logprobs: i32[s]; -1 = no logprobs.
      vocab_size: V.
      num_candidates: KC, as passed to ``sample``.

    Returns:
      A member of ``SAMPLER_VARIANTS``, to pass as ``sample(..., variant=)``.
    """
    needed = required_stages(temperature, top_k, top_p, min_p, repetition_penalty,
                             presence_penalty, frequency_penalty, logit_bias_ids, ban_active,
                             num_logprobs, vocab_size, num_candidates=num_candidates)
    return covering_variant(needed)


def covering_variant(needed: SamplerVariant) -> SamplerVariant:
    """The cheapest variant in ``COMPILED_VARIANTS`` that includes every stage of ``needed``."""
    for variant in COMPILED_VARIANTS:
        if variant.covers(needed):
            return variant
    raise AssertionError(f"no variant covers {needed}")  # MASKED covers everything


def masked_variant(variant: SamplerVariant) -> SamplerVariant:
    """The cheapest of ``MASKED_VARIANTS`` that covers ``variant``'s stages and the mask:
    the variant of a step with a constrained row whose rows need ``variant``."""
    return covering_variant(dataclasses.replace(variant, mask=True))
