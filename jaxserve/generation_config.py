"""Default sampling parameters from a model's ``generation_config.json`` (jax-free).

vLLM's ``--generation-config auto`` behaviour (``ModelConfig.get_diff_sampling_param``):
the file is read with ``transformers.GenerationConfig``; of the fields that
differ from transformers' defaults (``to_diff_dict``), ``temperature``,
``top_p``, ``top_k``, ``min_p`` and ``repetition_penalty`` become the default
of the ``SamplingParams`` field of the same name, and ``max_new_tokens`` the
default ``max_tokens``. As in vLLM, ``do_sample`` is not consulted (a file
with ``do_sample: false`` and a temperature still sets the temperature), and
every other field (``eos_token_id``, beam search, ...) is ignored here.

A request's explicit values always win over these defaults: the server merges
them under each request's fields (``jaxserve.api.prompts.RequestPreparer``),
``jaxserve.LLM`` uses them when ``generate`` gets no ``SamplingParams``.

Sources (``--generation-config`` / ``LLM(generation_config=...)``):
``"auto"`` = the model directory's file (none = no defaults), ``"vllm"`` =
ignore any file (``SamplingParams``' own defaults), or a directory holding a
``generation_config.json``.
"""

from __future__ import annotations

import argparse
import pathlib
from typing import Any

from jaxserve.sampling_params import SamplingParams

FILE_NAME = "generation_config.json"
AUTO, VLLM = "auto", "vllm"
# Fields whose name is the same in GenerationConfig and SamplingParams.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def load_sampling_defaults(model_dir: str | pathlib.Path,
                           source: str = AUTO) -> dict[str, Any]:
    """The default sampling parameters for ``model_dir`` (see the module docstring).

    Args:
      model_dir: the model directory.
      source: ``"auto"``, ``"vllm"`` or a directory with a ``generation_config.json``.

    Returns:
      ``SamplingParams`` keyword arguments, e.g. ``{"temperature": 0.2,
      "top_p": 0.9, "max_tokens": 256}``; ``{}`` for ``"vllm"`` or no file.

    Raises:
      FileNotFoundError: ``source`` is a directory without the file, or not a directory.
      ValueError: the file is not valid JSON for ``GenerationConfig``, or a
        value ``SamplingParams`` rejects (the file and the field are named).
    """
    if source == VLLM:
        return {}
    directory = pathlib.Path(model_dir if source == AUTO else source).expanduser()
    path = directory / FILE_NAME
    if not path.is_file():
        if source == AUTO:
            return {}
        raise FileNotFoundError(f"--generation-config {source!r}: no {FILE_NAME} there "
                                f"(pass auto, vllm, or a directory that has one)")
    from transformers import GenerationConfig  # heavy import, kept local

    try:
        config = GenerationConfig.from_pretrained(str(directory)).to_diff_dict()
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not a valid generation config: {err}") from None
    defaults = {name: config[name] for name in SAMPLING_FIELDS if config.get(name) is not None}
    if config.get("max_new_tokens") is not None:
        defaults["max_tokens"] = config["max_new_tokens"]
    try:
        SamplingParams.from_dict(defaults)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{path}: {err}") from None
    return defaults


def generation_config_source(value: str) -> str:
    """``--generation-config``'s argparse type: ``auto``, ``vllm`` or an existing directory.

    Raises:
      argparse.ArgumentTypeError: anything else (argparse prints it after the flag's name).
    """
    if value in (AUTO, VLLM) or pathlib.Path(value).expanduser().is_dir():
        return value
    raise argparse.ArgumentTypeError(f"expected auto, vllm or a directory, got {value!r}")
