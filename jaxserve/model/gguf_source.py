"""A model directory's GGUF source: the GGUF file it was converted from, named in the directory.

A directory converted from a GGUF file (the demo model, ``jaxserve.demo.convert``) names
that file in ``GGUF_SOURCE_FILE``, with the table of its tensors as ``gguf.GGUFReader``
read them (HF name → GGUF name, type, absolute byte offset, shape [out, in])::

    {"path": "../../gguf/SmolLM2-135M-Instruct.Q4_1.gguf",  (relative to the directory,
     "bytes": 98362432, "sha256": "b179c952…",               or absolute)
     "num_heads": 9, "num_kv_heads": 3,
     "tensors": {"model.layers.0.self_attn.q_proj.weight":
                 {"gguf_name": "blk.0.attn_q.weight", "type": "Q4_1",
                  "offset": 5345280, "shape": [576, 576]}, …}}

With it, ``load_model(..., quantization="int4")`` takes every decoder kernel whose GGUF
tensors are Q4_1 straight from the file's blocks (``quantization.int4_from_q4_1``)
instead of re-quantizing the float32 safetensors that were dequantized from them. The
table spares the load ``GGUFReader``'s parse of the whole header (about 3 s for the
demo file, nearly all of it the tokenizer's 98,000 strings): the blocks are read
through a memory map at the recorded offsets. The safetensors stay the directory's
weights: every other parameter, and every kernel of another GGUF type, is read from
them as before. A recorded file that is missing or differs from the record (size, then
sha256: about 0.1 s per 100 MB) is not used: the directory loads from its safetensors
alone, with a warning.

Names map as the converter maps them (``jaxserve.demo.tensors.hf_tensor_name``), and
the blocks come back in HF row order (``hf_rows``: q / k un-permuted; whole rows of
blocks move, as blocks run along the input axis). Block sizes: ``gguf.GGML_QUANT_SIZES``.

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
                      sha256: str | None = None, reader=None) -> dict:
    """Names ``gguf_path`` as ``model_dir``'s source in ``GGUF_SOURCE_FILE``; returns the record.

    The path is stored relative to ``model_dir`` (a cache moved whole keeps working);
    ``sha256``: the file's hex digest when already known (else computed); ``reader``: a
    ``gguf.GGUFReader`` of the file when one is open (else one is made, ~3 s). The record
    is replaced atomically (a temporary file, then ``os.replace``), mode 0644.

    Raises:
      jaxserve.demo.DemoModelError: a tensor name outside the llama set.
      ValueError: a file whose architecture is not llama.
    """
    from gguf import GGUFReader

    from jaxserve.demo.source import sha256_file
    from jaxserve.demo.tensors import hf_tensor_name

    model_dir, gguf_path = pathlib.Path(model_dir), pathlib.Path(gguf_path).absolute()
    reader = reader or GGUFReader(os.fspath(gguf_path))
    arch = reader.fields["general.architecture"].contents()
    if arch != "llama":
        raise ValueError(f"{gguf_path}: GGUF architecture {arch!r}, only 'llama' is read")
    heads = int(reader.fields["llama.attention.head_count"].contents())
    kv = reader.fields.get("llama.attention.head_count_kv")
    record = {"path": os.path.relpath(gguf_path, model_dir.absolute()),
              "bytes": gguf_path.stat().st_size,
              "sha256": sha256 or sha256_file(gguf_path),
              "num_heads": heads, "num_kv_heads": heads if kv is None else int(kv.contents()),
              "tensors": {hf_tensor_name(t.name): {
                  "gguf_name": t.name, "type": t.tensor_type.name, "offset": int(t.data_offset),
                  "shape": [int(n) for n in reversed(t.shape)]} for t in reader.tensors}}
    tmp = model_dir / f".{GGUF_SOURCE_FILE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.chmod(0o644)
    os.replace(tmp, model_dir / GGUF_SOURCE_FILE)
    return record


def open_gguf_source(model_dir: str | os.PathLike[str]) -> GgufSource | None:
    """The GGUF source ``model_dir`` names, checked against the record; None when the directory
    names none, or (logged as a warning) the file is missing or differs from the record.

    Raises:
      ValueError: a record that is not JSON with ``path``, ``bytes``, ``sha256``,
        ``num_heads``, ``num_kv_heads`` and ``tensors``.
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
        source = GgufSource(path, (int(record["num_heads"]), int(record["num_kv_heads"])),
                            dict(record["tensors"]))
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{record_path} is not a GGUF source record ({err!r})") from None
    if not path.is_file():
        problem = "is missing"
    elif path.stat().st_size != size:
        problem = f"has {path.stat().st_size} bytes, the record says {size}"
    elif sha256_file(path) != digest:
        problem = "has another sha256 than the record's"
    else:
        return source
    logger.warning("%s names %s as its GGUF source, which %s: loading the safetensors alone",
                   model_dir, path, problem)
    return None


class GgufSource:
    """The tensors of a GGUF file by Hugging Face name, from a source record's table.

    Attributes:
      path: the GGUF file.
      heads: (N, K), its query and KV heads (``hf_rows``'s q / k un-permutation).
      tensors: HF name → {"gguf_name", "type" (a ``GGMLQuantizationType`` name), "offset"
        (bytes from the file's start), "shape" [out, in]}.
    """

    def __init__(self, path: pathlib.Path, heads: tuple[int, int], tensors: dict[str, dict]):
        self.path, self.heads, self.tensors = path, heads, tensors

    def tensor_types(self) -> dict[str, str]:
        """HF name → the GGUF tensor type's name ("Q4_1", "Q8_0", "F32", …)."""
        return {name: t["type"] for name, t in self.tensors.items()}

    def q4_1_rows(self, hf_name: str) -> np.ndarray | None:
        """The Q4_1 tensor of HF name ``hf_name`` as its rows of blocks, u8[out, in / 32 · 20]
        in HF row order (``quantization.int4_from_q4_1``'s input), read through a memory map;
        None when the file holds that tensor in another type, or not at all."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        from jaxserve.demo.tensors import hf_rows

        tensor = self.tensors.get(hf_name)
        if tensor is None or tensor["type"] != GGMLQuantizationType.Q4_1.name:
            return None
        out, inputs = tensor["shape"]
        block_size, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType.Q4_1]
        rows = np.memmap(self.path, np.uint8, mode="r", offset=tensor["offset"],
                         shape=(out, inputs // block_size * block_bytes))
        return hf_rows(tensor["gguf_name"], rows, *self.heads)
