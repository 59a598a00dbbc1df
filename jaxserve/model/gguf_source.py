"""A model directory's GGUF source: the GGUF file it was converted from, named in the directory.

A directory converted from a GGUF file (the demo model, ``jaxserve.demo.convert``) names
that file in ``GGUF_SOURCE_FILE``::

    {"path": "../../gguf/SmolLM2-135M-Instruct.Q4_1.gguf",  (relative to the directory,
     "bytes": 98362432, "sha256": "b179c952…"}               or absolute)

With it, ``load_model(..., quantization="int4")`` takes every decoder kernel whose GGUF
tensors are Q4_1 straight from the file's blocks (``quantization.int4_from_q4_1``)
instead of re-quantizing the float32 safetensors that were dequantized from them. The
safetensors stay the directory's weights: every other parameter, and every kernel of
another GGUF type, is read from them as before. A recorded file that is missing or
differs from the record (size, then sha256: about 0.1 s per 100 MB) is not used: the
directory loads from its safetensors alone, with a warning.

Tensors are found by their Hugging Face names, mapped from the GGUF llama names as the
converter maps them (``jaxserve.demo.tensors.hf_tensor_name``), and come back in HF row
order (``hf_rows``: q / k un-permuted; whole rows of blocks move, as blocks run along
the input axis).

jax-free (numpy and the ``gguf`` package).
"""

from __future__ import annotations

import json
import logging
import os
import pathlib

import numpy as np

logger = logging.getLogger(__name__)

# The record's file name in a model directory.
GGUF_SOURCE_FILE = "gguf_source.json"


def write_gguf_source(model_dir: str | os.PathLike[str], gguf_path: str | os.PathLike[str],
                      sha256: str | None = None) -> dict:
    """Names ``gguf_path`` as ``model_dir``'s source in ``GGUF_SOURCE_FILE``; returns the record.

    The path is stored relative to ``model_dir`` (a cache moved whole keeps working);
    ``sha256``: the file's hex digest when already known (else computed). The record
    is replaced atomically (a temporary file, then ``os.replace``), mode 0644.
    """
    from jaxserve.demo.source import sha256_file

    model_dir, gguf_path = pathlib.Path(model_dir), pathlib.Path(gguf_path).absolute()
    record = {"path": os.path.relpath(gguf_path, model_dir.absolute()),
              "bytes": gguf_path.stat().st_size,
              "sha256": sha256 or sha256_file(gguf_path)}
    tmp = model_dir / f".{GGUF_SOURCE_FILE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.chmod(0o644)
    os.replace(tmp, model_dir / GGUF_SOURCE_FILE)
    return record


def source_path(model_dir: str | os.PathLike[str]) -> pathlib.Path | None:
    """The GGUF file ``model_dir`` names, checked against the record; None when the directory
    names none, or (logged as a warning) the file is missing or differs from the record.

    Raises:
      ValueError: a record that is not JSON with ``path``, ``bytes`` and ``sha256``.
    """
    from jaxserve.demo.source import sha256_file

    model_dir = pathlib.Path(model_dir)
    record_path = model_dir / GGUF_SOURCE_FILE
    if not record_path.is_file():
        return None
    try:
        record = json.loads(record_path.read_text())
        path = (model_dir / record["path"]).resolve()
        size, digest = int(record["bytes"]), record["sha256"]
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{record_path} is not a GGUF source record ({err!r})") from None
    if not path.is_file():
        problem = "is missing"
    elif path.stat().st_size != size:
        problem = f"has {path.stat().st_size} bytes, the record says {size}"
    elif sha256_file(path) != digest:
        problem = "has another sha256 than the record's"
    else:
        return path
    logger.warning("%s names %s as its GGUF source, which %s: loading the safetensors alone",
                   model_dir, path, problem)
    return None


class GgufSource:
    """The tensors of a llama GGUF file by Hugging Face name, rows in HF order.

    Raises (constructor): ``jaxserve.demo.DemoModelError`` for a tensor name outside the
    llama set, ValueError for a file that is not llama.
    """

    def __init__(self, path: str | os.PathLike[str]):
        from gguf import GGUFReader

        from jaxserve.demo.tensors import hf_tensor_name

        self.path = pathlib.Path(path)
        reader = GGUFReader(os.fspath(path))
        arch = reader.fields["general.architecture"].contents()
        if arch != "llama":
            raise ValueError(f"{path}: GGUF architecture {arch!r}, only 'llama' is read")
        heads = int(reader.fields["llama.attention.head_count"].contents())
        kv = reader.fields.get("llama.attention.head_count_kv")
        self._heads = (heads, heads if kv is None else int(kv.contents()))
        self._tensors = {hf_tensor_name(t.name): t for t in reader.tensors}

    def tensor_types(self) -> dict[str, str]:
        """HF name → the GGUF tensor type's name ("Q4_1", "Q8_0", "F32", …)."""
        return {name: t.tensor_type.name for name, t in self._tensors.items()}

    def q4_1_rows(self, hf_name: str) -> np.ndarray | None:
        """The Q4_1 tensor of HF name ``hf_name`` as its rows of blocks, u8[out, in / 32 · 20]
        in HF row order (``quantization.int4_from_q4_1``'s input); None when the file holds
        that tensor in another type, or not at all."""
        from gguf import GGMLQuantizationType
        from jaxserve.demo.tensors import hf_rows

        tensor = self._tensors.get(hf_name)
        if tensor is None or tensor.tensor_type != GGMLQuantizationType.Q4_1:
            return None
        rows = np.asarray(tensor.data)  # [ne1 = out, ne0 / 32 · 20] (the reader's memory map)
        return hf_rows(tensor.name, rows, *self._heads)
