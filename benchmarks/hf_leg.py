"""The Hugging Face transformers leg: the same prompts through ``model.generate``.

Batched and left-padded, greedy, float32 on the CPU by default (PyTorch;
``dtype`` and ``device`` change that). Requests are
sorted by output length (longest first) and cut into batches of
``batch_size``; each batch generates to its longest request's length with
``min_new_tokens`` = ``max_new_tokens`` (so EOS never ends it early, like
``ignore_eos``). Only each request's own output length counts as generated
tokens: the extra tokens a shorter request in the batch is carried along
for are work transformers does but the user did not ask for (reported as
``computed_tokens``). Sorting by output length keeps that waste small;
prompt padding (requests of a batch have different prompt lengths) is the
other cost of static batching.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from benchmarks.dataset import Workload

logger = logging.getLogger(__name__)


def batches(workload: Workload, batch_size: int) -> list[list[int]]:
    """Request indices, longest output first, in batches of ``batch_size``.

    Raises:
      ValueError: batch_size < 1.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = sorted(range(len(workload)), key=lambda i: (-workload.output_lens[i], i))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def _pad_left(prompts: list[tuple[int, ...]], pad_id: int, device: str):
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def load(model_dir: str, *, dtype: str = "float32", device: str = "cpu"):
    """The model on ``device`` in ``dtype``, its pad token id and the load time in seconds."""
    import torch
    import transformers

    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    load_seconds = time.perf_counter() - start
    config = model.generation_config
    eos = config.eos_token_id
    pad_id = config.pad_token_id if config.pad_token_id is not None else (
        eos[0] if isinstance(eos, list) else eos) or 0
    return model, pad_id, load_seconds


def generate(model, pad_id: int, workload: Workload, *, batch_size: int = 16,
             device: str = "cpu") -> dict[str, Any]:
    """Warms up on one short batch, then generates the workload timed (module docstring).

    Returns elapsed seconds (generation only), ``output_tokens`` (the
    requests' own), ``computed_tokens`` (including the batch-padding tail),
    tokens/s and the batching used.
    """
    import torch
    import transformers
    from tqdm.auto import tqdm

    groups = batches(workload, batch_size)
    with torch.inference_mode():  # warm-up: first-call overheads, one short batch
        ids, mask = _pad_left([workload.prompts[i] for i in groups[-1]], pad_id, device)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, min_new_tokens=2,
                       do_sample=False, pad_token_id=pad_id)
    computed = 0
    bar = tqdm(total=workload.num_output_tokens, desc="transformers", unit="tok")
    start = time.perf_counter()
    with torch.inference_mode():
        for group in groups:
            ids, mask = _pad_left([workload.prompts[i] for i in group], pad_id, device)
            new = max(workload.output_lens[i] for i in group)
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False, pad_token_id=pad_id)
            if out.shape[1] - ids.shape[1] != new:
                raise RuntimeError(f"transformers generated {out.shape[1] - ids.shape[1]} "
                                   f"tokens, asked for {new}")
            computed += new * len(group)
            bar.update(sum(workload.output_lens[i] for i in group))
    elapsed = time.perf_counter() - start
    bar.close()
    generated = workload.num_output_tokens
    return {"elapsed": elapsed, "output_tokens": generated,
            "computed_tokens": computed, "output_tokens_per_s": generated / elapsed,
            "computed_tokens_per_s": computed / elapsed,
            "total_tokens_per_s": (generated + workload.num_prompt_tokens) / elapsed,
            "batch_size": batch_size, "num_batches": len(groups),
            "device": device,
            "torch_threads": torch.get_num_threads(), "transformers": transformers.__version__,
            "torch": torch.__version__,
            "batching": "sorted by output length, generate to the batch's longest, "
                        "count each request's own tokens"}


def run(workload: Workload, *, model_dir: str, batch_size: int = 16, dtype: str = "float32",
        device: str = "cpu") -> dict[str, Any]:
    """Loads the model (``dtype``, on ``device``) and generates the workload (``generate``).

    Returns ``generate``'s dict plus ``load_seconds`` and ``dtype``.
    """
    model, pad_id, load_seconds = load(model_dir, dtype=dtype, device=device)
    result = generate(model, pad_id, workload, batch_size=batch_size, device=device)
    return {"load_seconds": load_seconds, "dtype": dtype, **result}
