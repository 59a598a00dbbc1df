"""The files a model directory needs, checked before any process starts (jax-free).

``jaxserve serve`` and ``jaxserve.LLM`` call ``check_model_files`` on the
resolved directory (``jaxserve.demo_model.resolve_model_path`` has checked
``config.json``), so a directory without weights or a tokenizer fails in one
line naming what is missing, instead of a traceback from a child process.

What counts (the readers' own rules):

- weights: any ``*.safetensors`` file, or the parameter checkpoint
  ``jaxserve save-checkpoint`` writes (its ``jaxserve_checkpoint.json``);
  ``jaxserve.model.loader`` reads nothing else (``pytorch_model.bin`` or
  ``*.gguf`` are named as unreadable);
- tokenizer: one of ``tokenizer.json`` (fast), ``tokenizer.model``
  (SentencePiece), ``vocab.json`` + ``merges.txt`` (byte-level BPE) or
  ``vocab.txt`` (WordPiece) — what ``transformers.AutoTokenizer`` can build from.
"""

from __future__ import annotations

import os
import pathlib

# Alternatives, each a set of files that together make a tokenizer.
TOKENIZER_FILE_SETS = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"),
                       ("vocab.txt",))
_OTHER_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.gguf")
CHECKPOINT_FILE = "jaxserve_checkpoint.json"  # a parameter checkpoint's metadata (model/checkpoint.py)


def missing_model_files(model_dir: str | os.PathLike[str],
                        tokenizer_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """What ``model_dir`` (weights) and ``tokenizer_dir`` (default ``model_dir``) lack.

    Returns:
      One phrase per missing part, e.g. ``["the weights (*.safetensors)"]``;
      empty when both are there.
    """
    model_dir = pathlib.Path(model_dir)
    problems = []
    if not any(model_dir.glob("*.safetensors")) and not (model_dir / CHECKPOINT_FILE).is_file():
        others = sorted(p.name for pattern in _OTHER_WEIGHTS for p in model_dir.glob(pattern))
        found = f"; found {', '.join(others)}, which jaxserve cannot read" if others else ""
        problems.append(f"the weights (*.safetensors{found})")
    tokenizer = pathlib.Path(tokenizer_dir) if tokenizer_dir is not None else model_dir
    if not any(all((tokenizer / name).is_file() for name in names)
               for names in TOKENIZER_FILE_SETS):
        alternatives = ", ".join(" + ".join(names) for names in TOKENIZER_FILE_SETS)
        where = "" if tokenizer == model_dir else f" in {str(tokenizer)!r}"
        problems.append(f"the tokenizer{where} (one of {alternatives})")
    return problems


def check_model_files(model_dir: str | os.PathLike[str],
                      tokenizer_dir: str | os.PathLike[str] | None = None) -> None:
    """Raises unless ``model_dir`` has weights and ``tokenizer_dir`` (or ``model_dir``) a tokenizer.

    Raises:
      FileNotFoundError: one line naming the directory and every missing part.
    """
    problems = missing_model_files(model_dir, tokenizer_dir)
    if problems:
        raise FileNotFoundError(
            f"model directory {str(model_dir)!r} lacks {' and '.join(problems)}; copy them "
            f"from the model's Hugging Face repository (or run without --model for the demo model)")
