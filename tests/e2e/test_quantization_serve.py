"""``jaxserve serve -q int4`` end to end: the flag crosses the launcher, the engine process and
the gRPC worker (``InitializeRequest.quantization``), and ``GetModelInfo`` reports it (and
the KV cache's dtype).

One server start for both methods: the served path carries the method as a string
(``tests/engine/test_engine_flags.py`` checks both values reach ``WorkerInit``); int4 is
served here because it is the one whose kernels differ most from the float path.

A tiny random-weight Llama (with the demo model's tokenizer) behind the real launcher,
api, engine and worker processes on loopback. The served greedy tokens start with the
argmax of the int4 model's logits through the worker's step body in this process.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.client import Client
from tests.e2e.helpers import serve
from tests.model.hf_tiny import copy_tokenizer, make_tiny_model

pytestmark = pytest.mark.slow

ENGINE = ("--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--max-model-len", "128",
          "--block-size", "4", "--num-kv-blocks", "80")
PROMPT = [5, 9, 13, 17, 21, 25]


def test_serve_int4_reports_and_generates(tmp_path, demo_model_dir):
    make_tiny_model("LlamaForCausalLM", tmp_path, initializer_range=0.02)
    copy_tokenizer(demo_model_dir, tmp_path)
    with serve(tmp_path, ENGINE + ("-q", "int4")) as launcher:
        with Client(launcher.address, timeout=120) as client:
            info = client.model_info()
            assert info.quantization == "int4"
            assert info.kv_cache_dtype == "auto"  # the default --kv-cache-dtype
            tokens = client.generate(PROMPT, max_tokens=4, temperature=0.0,
                                     ignore_eos=True).token_ids
    assert len(tokens) == 4
    from jaxserve.model.loader import load_model  # jax in this process only after the server
    from tests.model.paged_runner import PagedRunner

    config, graphdef, state = load_model(tmp_path, quantization="int4")
    logits = PagedRunner(config, graphdef, state, backend="cpu").step({"s": PROMPT})["s"]
    assert tokens[0] == int(np.argmax(logits))
