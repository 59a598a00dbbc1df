"""A stand-in ``vllm`` package and an interpreter that imports it, for ``--vllm-python``.

vLLM itself is not installed in CI; the fake has its API's shape
(``LLM.generate`` on token prompts, ``SamplingParams``) so that the real
``vllm_runner.py`` runs in a subprocess through a wrapper interpreter.
"""

from __future__ import annotations

import stat
import sys
import textwrap

FAKE_VLLM = '''
import cProfile  # vLLM imports it through torch: our folder must not shadow ``profile``
import types

__version__ = "0.0-fake"


class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos):
        assert temperature == 0.0 and ignore_eos
        self.max_tokens = max_tokens


class LLM:
    def __init__(self, model, dtype, max_model_len, seed, max_num_seqs, max_num_batched_tokens,
                 gpu_memory_utilization):
        assert dtype == "float32" and max_model_len > 0 and 0 < gpu_memory_utilization <= 1

    def get_tokenizer(self):
        return types.SimpleNamespace(vocab_size=1000)

    def generate(self, prompts, params, use_tqdm):
        params = params if isinstance(params, list) else [params] * len(prompts)
        short = __import__("os").environ.get("FAKE_VLLM_SHORT") == "1"
        return [types.SimpleNamespace(outputs=[types.SimpleNamespace(
                    token_ids=list(range(p.max_tokens - short)))])
                for p in params]
'''


def fake_python(tmp_path, short=False) -> str:
    """A wrapper interpreter under ``tmp_path`` whose ``vllm`` is the fake (``short``: one
    token fewer than asked per request)."""
    package = tmp_path / "site" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_VLLM)
    wrapper = tmp_path / "python"
    wrapper.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        FAKE_VLLM_SHORT={int(short)} PYTHONPATH={tmp_path / 'site'} exec {sys.executable} "$@"
        """))
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    return str(wrapper)
