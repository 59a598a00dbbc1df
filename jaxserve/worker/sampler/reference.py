"""NumPy reference of the sampled distribution (the oracle in the tests).

Straight from the definitions, one row at a time, by full sorting, in
float64, starting from ``SamplingParams`` (not from ``SamplingMetadata``),
so it shares no code with the jitted sampler. Only z = logits / temperature is
formed in float32, as the sampler does, so that both see the same ties.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxserve.sampling_params import SamplingParams


def penalized_logits(logits: np.ndarray, params: SamplingParams, prompt_ids: Sequence[int],
                     output_ids: Sequence[int], eos_token_ids: Sequence[int] = ()
                     ) -> np.ndarray:
    """f64[V]: one row after logit bias, min-tokens bans and penalties (vLLM order)."""
    out = np.asarray(logits, np.float64).copy()
    for token, bias in (params.logit_bias or {}).items():
        out[token] += bias
    if len(output_ids) < params.min_tokens:
        out[list(params.all_stop_token_ids(eos_token_ids))] = -np.inf
    counts = np.bincount(np.asarray(output_ids, np.int64), minlength=out.size)
    seen = counts > 0
    seen_any = seen.copy()
    seen_any[np.asarray(prompt_ids, np.int64)] = True
    rep = params.repetition_penalty
    out[seen_any] = np.where(out[seen_any] > 0, out[seen_any] / rep, out[seen_any] * rep)
    return out - params.frequency_penalty * counts - params.presence_penalty * seen


def keep_mask(processed: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, float]:
    """Tokens kept by min-p, top-k and top-p, and the decision margin.

    Args:
      processed: f32[V] logits after ``penalized_logits`` (cast to float32).
      params: the request's parameters (ignored for greedy rows: all kept).

    Returns:
      keep: bool[V].
      margin: the smallest distance of a min-p or top-p comparison from its
        boundary (relative to the mass for top-p); float32 and float64
        evaluations can only disagree where it is below ~1e-6.
    """
    vocab = processed.size
    keep = np.ones(vocab, bool)
    if params.is_greedy:
        return keep, np.inf
    z = (np.asarray(processed, np.float32) / np.float32(params.temperature)).astype(np.float64)
    zmax = z.max()
    margin = np.inf
    if params.min_p > 0:
        bound = zmax + np.log(params.min_p)
        keep &= z >= bound
        margin = min(margin, np.min(np.abs(z[np.isfinite(z)] - bound)))
    if 0 < params.top_k < vocab:
        kth = np.sort(z)[::-1][params.top_k - 1]
        keep &= z >= kth
    if params.top_p < 1:
        kept = np.sort(z[keep])[::-1]  # descending, ties adjacent
        probs = np.exp(kept - zmax)
        cum = np.cumsum(probs)
        target = params.top_p * cum[-1]
        first = int(np.argmax(cum >= target))
        keep &= z >= kept[first]
        margin = min(margin, np.min(np.abs(cum - target)) / cum[-1])
    return keep, margin


def distribution(logits: np.ndarray, params: SamplingParams, prompt_ids: Sequence[int],
                 output_ids: Sequence[int], eos_token_ids: Sequence[int] = ()
                 ) -> np.ndarray:
    """f64[V]: the exact distribution the sampler draws one row's token from.

    Greedy rows: a one-hot at the first argmax of the penalized logits.
    """
    processed = penalized_logits(logits, params, prompt_ids, output_ids, eos_token_ids)
    if params.is_greedy:
        probs = np.zeros(processed.size)
        probs[int(np.argmax(processed))] = 1.0
        return probs
    keep, _ = keep_mask(processed.astype(np.float32), params)
    z = (processed.astype(np.float32) / np.float32(params.temperature)).astype(np.float64)
    w = np.where(keep, np.exp(z - z[keep].max()), 0.0)
    return w / w.sum()


def log_softmax(x: np.ndarray) -> np.ndarray:
    """f64 log_softmax over the last axis (-inf entries stay -inf)."""
    x = np.asarray(x, np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))
