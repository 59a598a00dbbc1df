"""A proposer that drafts from known outputs (tests of speculative decoding)."""

from __future__ import annotations

import numpy as np


class OracleProposer:
    """Stands in for ``ngram_proposer.propose_ngram``: drafts what a reference run generated.

    A sequence that is a prefix of one of ``references`` (prompt + that run's output)
    gets the reference's next tokens; every ``break_every``-th proposal has its second
    draft changed, so that rejections happen too. ``proposals`` counts each one's drafts.
    """

    def __init__(self, references: list[list[int]], vocab_size: int, break_every: int = 3):
        self.references, self.vocab_size, self.break_every = references, vocab_size, break_every
        self.proposals: list[int] = []

    def __call__(self, token_ids, *, num_speculative_tokens, prompt_lookup_min,
                 prompt_lookup_max) -> np.ndarray:
        seq = token_ids.tolist()
        for full in self.references:
            if len(full) > len(seq) and full[:len(seq)] == seq:
                drafts = full[len(seq):len(seq) + num_speculative_tokens]
                self.proposals.append(len(drafts))
                if len(self.proposals) % self.break_every == 0 and len(drafts) > 1:
                    drafts[1] = (drafts[1] + 1) % self.vocab_size
                return np.array(drafts, np.int32)
        return np.zeros(0, np.int32)
