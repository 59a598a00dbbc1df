"""Test helper: runs requests through an ``EngineCore`` until all finish."""

from __future__ import annotations

from jaxserve.engine import EngineCore, EngineCoreRequest


def generate(core: EngineCore, prompts, params) -> dict[str, list[int]]:
    """Adds ``prompts`` (token id lists) as requests ``r0, r1, ...`` with ``params``; steps until
    done; returns request id -> its generated token ids."""
    for i, prompt in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"r{i}", prompt, params))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
    return tokens
