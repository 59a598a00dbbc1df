"""A ShareGPT-like workload from a fixed seed: prompt and output lengths, random prompt ids.

ShareGPT conversations (the workload of vLLM's and most serving benchmarks)
have long-tailed lengths: many short prompts and answers, a few long ones.
We draw both lengths from log-normal distributions clipped to the requested
ranges (defaults: prompts 32–1024 tokens, outputs 32–512) rather than ship
the data set. The medians sit near the geometric middle of each range
(~181 prompt, ~128 output tokens at the defaults) and sigma 0.8 gives the
tail. Prompt token ids are uniform over the vocabulary minus its first 100
ids (where special tokens usually live); outputs run to their length
(``ignore_eos``), so every engine generates exactly the same number of tokens.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

_SIGMA = 0.8


@dataclasses.dataclass(frozen=True, slots=True)
class Workload:
    """N requests: ``prompts[i]`` (token ids) and ``output_lens[i]`` (tokens to generate)."""

    prompts: tuple[tuple[int, ...], ...]
    output_lens: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.output_lens):
            raise ValueError(f"{len(self.prompts)} prompts but {len(self.output_lens)} "
                             "output lengths")

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def input_lens(self) -> tuple[int, ...]:
        return tuple(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(self.input_lens)

    def summary(self) -> dict[str, object]:
        ins, outs = np.asarray(self.input_lens), np.asarray(self.output_lens)
        return {"num_requests": len(self), "prompt_tokens": int(ins.sum()),
                "output_tokens": int(outs.sum()),
                "input_len": {"min": int(ins.min()), "median": float(np.median(ins)),
                              "max": int(ins.max())},
                "output_len": {"min": int(outs.min()), "median": float(np.median(outs)),
                               "max": int(outs.max())}}


def _clipped_lognormal(rng: np.random.Generator, n: int, low: int, high: int) -> np.ndarray:
    median = math.sqrt(low * high)
    draws = rng.lognormal(math.log(median), _SIGMA, size=n)
    return np.clip(np.rint(draws), low, high).astype(np.int64)


def sharegpt_like(num_requests: int, vocab_size: int, *, seed: int = 0,
                  input_range: tuple[int, int] = (32, 1024),
                  output_range: tuple[int, int] = (32, 512)) -> Workload:
    """``num_requests`` requests with ShareGPT-like lengths (see the module docstring).

    Args:
      vocab_size: V; prompt ids are drawn from [100, V) (or [0, V) when V <= 200).
      input_range, output_range: inclusive (min, max) lengths in tokens.

    Raises:
      ValueError: num_requests < 1 or a range with min < 1 or min > max.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    for name, (low, high) in (("input_range", input_range), ("output_range", output_range)):
        if not 1 <= low <= high:
            raise ValueError(f"{name} must satisfy 1 <= min <= max, got {(low, high)}")
    rng = np.random.default_rng(seed)
    ins = _clipped_lognormal(rng, num_requests, *input_range)
    outs = _clipped_lognormal(rng, num_requests, *output_range)
    first = 100 if vocab_size > 200 else 0
    prompts = tuple(tuple(int(t) for t in rng.integers(first, vocab_size, n)) for n in ins)
    return Workload(prompts, tuple(int(o) for o in outs))


def fixed_lengths(num_requests: int, vocab_size: int, input_len: int, output_len: int, *,
                  seed: int = 0) -> Workload:
    """``num_requests`` random prompts of ``input_len`` tokens, each generating ``output_len``."""
    return sharegpt_like(num_requests, vocab_size, seed=seed, input_range=(input_len, input_len),
                         output_range=(output_len, output_len))
