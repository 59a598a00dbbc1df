"""The sampler: every vLLM sampling parameter in one jitted function.

``sample(logits, metadata, server_key)`` draws one token per row; see
``sampler.py`` for the order of operations, ``gumbel.py`` for the sampling
method and seeding, ``top_k_top_p.py`` for the filters, ``penalties.py`` for
bias, bans and penalties, ``logprobs.py`` for logprobs, and ``reference.py``
for the NumPy reference used by the tests.
"""

from jaxserve.worker.sampler.logprobs import token_logprobs
from jaxserve.worker.sampler.metadata import (SamplingMetadata, build_sampling_metadata,
                                              update_output_counts)
from jaxserve.worker.sampler.sampler import SamplerOutput, process_logits, sample
from jaxserve.worker.sampler.top_k_top_p import NUM_CANDIDATES

__all__ = [
    "NUM_CANDIDATES",
    "SamplerOutput",
    "SamplingMetadata",
    "build_sampling_metadata",
    "process_logits",
    "sample",
    "token_logprobs",
    "update_output_counts",
]
