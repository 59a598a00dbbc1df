"""A script that never shuts its ``LLM`` down still exits cleanly.

The middle sampler variants compile in a background thread after the
engine is ready (docs/worker.md). A daemon thread still inside an XLA
compile when the interpreter finalizes aborts the process (SIGABRT,
"FATAL: exception not rethrown"), which is what a short script that
generates once and ends without ``llm.shutdown()`` did, every time.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import sys
    from jaxserve import LLM, SamplingParams
    llm = LLM(sys.argv[1], max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]},
                       SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    print("tokens", out[0].outputs[0].token_ids, flush=True)
    # no llm.shutdown(): the background compile may still be running here
""")


def test_script_without_shutdown_exits_zero(demo_model_dir):
    # The demo model: its vocabulary makes the background samplers take seconds,
    # far longer than the script's one short generate.
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(demo_model_dir)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tokens [" in proc.stdout
