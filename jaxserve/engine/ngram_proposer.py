"""N-gram prompt lookup: draft tokens copied from a sequence's own earlier text (jax-free).

vLLM's ``ngram`` speculative method (prompt lookup decoding, Saxena 2023): when
the last n tokens of a sequence appeared earlier in it (prompt or output), the
tokens that followed them then are proposed as its next tokens. It costs no
model and wins where outputs copy their input: summaries and edits of a given
text, code refactoring, retrieval-augmented answers.

The match is the longest suffix of ``prompt_lookup_min`` .. ``prompt_lookup_max``
tokens that occurred before; among equally long matches the latest (nearest
context) is taken. Finding it costs one compare over the sequence (where did
its last token occur?) plus ``prompt_lookup_max`` compares per occurrence.
"""

from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: np.ndarray, *, num_speculative_tokens: int,
                  prompt_lookup_min: int, prompt_lookup_max: int) -> np.ndarray:
    """Draft tokens for a sequence, or none.

    Args:
      token_ids: i32[L] the sequence so far (prompt, then output).
      num_speculative_tokens: k, the most drafts to return.
      prompt_lookup_min / prompt_lookup_max: the shortest / longest suffix
        n-gram to look up (tokens), 1 <= min <= max.

    Returns:
      i32[<= k]: the tokens that followed the latest earlier occurrence of the
      longest matching suffix; empty when no suffix of ``prompt_lookup_min``
      tokens occurred before.
    """
    tokens = np.asarray(token_ids, np.int32)
    length = len(tokens)
    if length < 2 or num_speculative_tokens < 1:
        return np.zeros(0, np.int32)
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # [c] earlier occurrences of the last token
    if not ends.size:
        return np.zeros(0, np.int32)
    matched = np.ones(len(ends), np.int32)  # [c] suffix tokens matched backwards from each
    alive = np.ones(len(ends), bool)
    for back in range(1, min(prompt_lookup_max, length - 1)):
        here = ends - back  # [c]
        alive &= (here >= 0) & (tokens[np.maximum(here, 0)] == tokens[length - 1 - back])
        matched += alive
        if not alive.any():
            break
    best = int(matched.max())
    if best < prompt_lookup_min:
        return np.zeros(0, np.int32)
    start = int(ends[matched == best][-1]) + 1
    return tokens[start:start + num_speculative_tokens].copy()
