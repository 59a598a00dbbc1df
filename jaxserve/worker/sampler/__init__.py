"""The sampler: every vLLM sampling parameter in one jitted function.

``sample(logits, metadata, server_key, variant=...)`` draws one token per
row; see ``variants.py`` for the static variants the host chooses between
(``choose_variant``), ``sampler.py`` for the order of operations,
``gumbel.py`` for the sampling method and seeding, ``top_k_top_p.py`` and
``threshold_search.py`` for the filters, ``penalties.py`` for bias, bans and
penalties, ``logprobs.py`` for logprobs, ``bitmask.py`` for structured-output masks,
``speculative.py`` for verifying draft tokens, and ``reference.py`` for the
NumPy reference used by the tests.
"""

from jaxserve.worker.sampler.logprobs import token_logprobs
from jaxserve.worker.sampler.metadata import (SamplingMetadata, build_sampling_metadata,
                                              update_output_counts)
from jaxserve.worker.sampler.sampler import SamplerOutput, process_logits, sample
from jaxserve.worker.sampler.speculative import count_earlier_drafts, verify_drafts
from jaxserve.worker.sampler.top_k_top_p import NUM_CANDIDATES
from jaxserve.worker.sampler.variants import (COMPILED_VARIANTS, FULL, GREEDY, MASKED,
                                              MASKED_SAMPLED, MASKED_VARIANTS, PROCESSED,
                                              SAMPLED, SAMPLER_VARIANTS, SamplerVariant,
                                              choose_variant, covering_variant, masked_variant)

__all__ = [
    "COMPILED_VARIANTS",
    "FULL",
    "GREEDY",
    "MASKED",
    "MASKED_SAMPLED",
    "MASKED_VARIANTS",
    "NUM_CANDIDATES",
    "PROCESSED",
    "SAMPLED",
    "SAMPLER_VARIANTS",
    "SamplerVariant",
    "SamplerOutput",
    "SamplingMetadata",
    "build_sampling_metadata",
    "choose_variant",
    "count_earlier_drafts",
    "covering_variant",
    "masked_variant",
    "process_logits",
    "sample",
    "token_logprobs",
    "update_output_counts",
    "verify_drafts",
]
