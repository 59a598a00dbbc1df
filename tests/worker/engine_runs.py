"""What the in-process engine tests share: running requests to the end, and
shutting every engine down after its test.

An engine's worker compiles its middle sampler variants on a background
thread; an engine left running keeps compiling beside the tests after it
(its CPU time, and its log lines in their ``caplog``).
"""

from __future__ import annotations

import threading

from jaxserve.engine import EngineCore, EngineCoreRequest
from jaxserve.worker.compile_manager import BACKGROUND_COMPILE_THREAD

_ENGINES: list[EngineCore] = []


def tracked(engine: EngineCore) -> EngineCore:
    """Returns ``engine``, shut down after the test."""
    _ENGINES.append(engine)
    return engine


def shut_down_tracked() -> None:
    """Shuts down every engine ``tracked`` so far (``tests/worker/conftest.py`` calls it
    after each test)."""
    while _ENGINES:
        _ENGINES.pop().shutdown()


def join_background_compiles() -> None:
    """Waits for every background-compile thread of this process, earlier tests' workers'
    too: a test that compares the process-wide count (``compile_manager.COUNTER.compiles``)
    must not see another test's thread still compiling."""
    for thread in threading.enumerate():
        if thread.name == BACKGROUND_COMPILE_THREAD:
            thread.join()


def run_engine(engine: EngineCore, requests) -> tuple[dict, dict]:
    """Adds ``requests`` ((request_id, prompt token ids, SamplingParams) triples) and steps
    until none is unfinished; every KV block must have come back.

    Returns:
      (tokens, logprobs): each keyed by (request_id, index), the concatenated
      ``new_token_ids`` and ``new_logprobs`` (absent where none were asked for).
    """
    for rid, prompt, sp in requests:
        engine.add_request(EngineCoreRequest(rid, prompt, sp))
    tokens, logprobs = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            key = (out.request_id, out.index)
            tokens.setdefault(key, []).extend(out.new_token_ids)
            if out.new_logprobs:
                logprobs.setdefault(key, []).extend(out.new_logprobs)
    assert engine.stats().kv_blocks_used == 0  # every block came back
    return tokens, logprobs
