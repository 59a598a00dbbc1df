"""The llama.cpp leg: batch-1 decode through ``llama_cpp`` (llama-cpp-python), F32 GGUF.

Runs only where ``llama_cpp`` is importable and an F32 GGUF of the model is
on disk (nothing is downloaded): ``--gguf PATH``, else a ``*.gguf`` whose
name says F32 under ``$JAXSERVE_CACHE/gguf`` (the demo model's cache). The
demo model's own GGUF there is the Q4_1 source its float32 weights were
dequantized from: a quantized run would not compare like with like, so it
is not run as such. When it is the only GGUF there, ``available`` writes its
F32 twin beside it (``write_f32_gguf``: the same metadata, every tensor
dequantized to float32, the very weights the other legs run). Otherwise the
leg returns ``{"error": why}``.

One request: the prompt evaluated, then greedy tokens (``temp=0``) until
the output length, end-of-sequence ignored; all cores (``n_threads``).
Timed: prompt evaluation plus generation, like the other legs' batch-1 run.

Quantized variants (``cpu_side_by_side --quantized``): ``quantized_gguf`` makes a
Q8_0 or Q4_0 GGUF from the F32 one with llama.cpp's own quantizer
(``llama_cpp.llama_model_quantize``, ``LLAMA_FTYPE_MOSTLY_Q8_0`` / ``_Q4_0``, its
default per-tensor choices) and caches it beside it (``<name>.Q8_0.gguf`` /
``<name>.Q4_0.gguf``); ``gguf_decode_bytes`` gives the bytes of its quantized
weights a batch-1 token reads (its bandwidth floor's numerator).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import pathlib
import re
import time
from typing import Any

from benchmarks.dataset import Workload

logger = logging.getLogger(__name__)


def find_gguf(gguf: str | None) -> tuple[pathlib.Path | None, str]:
    """The F32 GGUF to run and, when there is none, why (what was looked at)."""
    if gguf:
        path = pathlib.Path(gguf)
        return (path, "") if path.is_file() else (None, f"--gguf {gguf}: no such file")
    from jaxserve.demo_model import cache_root

    folder = cache_root() / "gguf"
    found = sorted(folder.glob("*.gguf")) if folder.is_dir() else []
    f32 = [p for p in found if "F32" in p.name.upper()]
    if f32:
        return f32[0], ""
    others = ", ".join(p.name for p in found) or "none"
    return None, (f"no F32 GGUF under {folder} (GGUF files there: {others}; a quantized one "
                  "is not comparable with the float32 legs) and no --gguf given")


def write_f32_gguf(source: pathlib.Path, dest: pathlib.Path) -> pathlib.Path:
    """Writes ``source`` again as ``dest`` with every tensor dequantized to float32.

    The metadata is copied as it is, except ``general.file_type``, which says
    all-F32 (``gguf.LlamaFileType.ALL_F32``). Dequantization is the ``gguf``
    package's (``gguf.quants.dequantize``), as for the demo model's
    safetensors, so both hold the same float32 weights. Written to a temporary
    name (one per process) and renamed, so a reader never sees half a file and
    a failure leaves none behind. Returns ``dest``.

    Raises:
      OSError: ``source`` unreadable or ``dest`` unwritable.
      ValueError: ``source`` is not a GGUF, or names no architecture.
      NotImplementedError: a tensor type ``gguf`` cannot dequantize.
      Whatever else the ``gguf`` package raises on a malformed file (it
      raises, e.g., IndexError on a truncated one).
    """
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(source))
    arch_field = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    if arch_field is None:
        raise ValueError(f"{source} has no {gguf.Keys.General.ARCHITECTURE}")
    tmp = dest.with_name(f"{dest.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), arch_field.contents())
    try:
        for field in reader.fields.values():
            if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
                continue  # written by GGUFWriter itself
            vtype = field.types[0]
            value = field.contents()
            if field.name == gguf.Keys.General.FILE_TYPE:
                value = int(gguf.LlamaFileType.ALL_F32)
            sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, value, vtype, sub_type=sub_type)
        for tensor in reader.tensors:
            weights = dequantize(tensor.data, tensor.tensor_type)
            writer.add_tensor(tensor.name, np.ascontiguousarray(weights, dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, dest)
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)
    return dest


# The quantization suffix of a GGUF's file name, as llama.cpp's tools write it
# ("SmolLM2-135M-Instruct.Q4_1.gguf", "Llama-3-8B-Q4_K_M.gguf", "x.IQ2_XS.gguf").
_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d\w*|BF16|F16|F32)$", re.IGNORECASE)


def f32_twin_name(source: pathlib.Path) -> str:
    """The F32 twin's file name: ``source``'s, its quantization suffix replaced by ``.F32``.

    ``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``SmolLM2-135M-Instruct.F32.gguf``;
    a name with no known suffix keeps its whole stem (``SmolLM2-1.7B.gguf`` ->
    ``SmolLM2-1.7B.F32.gguf``).
    """
    stem = source.name[:-len(".gguf")] if source.name.endswith(".gguf") else source.stem
    return f"{_QUANT_SUFFIX.sub('', stem)}.F32.gguf"


def _f32_twin(folder: pathlib.Path) -> tuple[pathlib.Path | None, str]:
    """(the F32 GGUF written from the only GGUF in ``folder``, "") or (None, why not)."""
    found = sorted(folder.glob("*.gguf")) if folder.is_dir() else []
    if len(found) != 1:
        return None, f"{len(found)} GGUF files under {folder}, not one to write an F32 twin of"
    source = found[0]
    dest = source.with_name(f32_twin_name(source))
    logger.info("writing %s from %s (every tensor dequantized to float32)", dest.name, source.name)
    try:
        return write_f32_gguf(source, dest), ""
    except Exception as err:  # noqa: BLE001 - a malformed GGUF raises many kinds; the leg reports it
        logger.warning("could not write an F32 twin of %s", source, exc_info=True)
        return None, f"could not write an F32 twin of {source}: {type(err).__name__}: {err}"


def available(gguf: str | None) -> tuple[pathlib.Path | None, str]:
    """(GGUF path, "") when the leg can run, else (None, why not).

    With no ``gguf`` given and no F32 GGUF in the demo model's cache, writes
    the F32 twin of the quantized GGUF there (``write_f32_gguf``).
    """
    if importlib.util.find_spec("llama_cpp") is None:
        return None, "llama_cpp (llama-cpp-python) is not importable here"
    path, why = find_gguf(gguf)
    if path is None and not gguf:
        from jaxserve.demo_model import cache_root

        path, why_not = _f32_twin(cache_root() / "gguf")
        why = f"{why}; {why_not}" if path is None else ""
    return path, why


# The quantized GGUF types made for ``cpu_side_by_side --quantized``: name → llama.cpp ftype.
QUANTIZED_TYPES = {"Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0"}


def quantized_name(f32: pathlib.Path, kind: str = "Q8_0") -> str:
    """The ``kind`` GGUF's file name beside the F32 one: ``X.F32.gguf`` -> ``X.<kind>.gguf``."""
    stem = f32.name[:-len(".gguf")] if f32.name.endswith(".gguf") else f32.stem
    return f"{_QUANT_SUFFIX.sub('', stem)}.{kind}.gguf"


def quantized_gguf(f32: pathlib.Path, kind: str = "Q8_0") -> tuple[pathlib.Path | None, str]:
    """(the ``kind`` GGUF (``QUANTIZED_TYPES``: Q8_0 or Q4_0) made from ``f32`` by llama.cpp's
    quantizer with its default choices per tensor, "") or (None, why not).

    Cached beside ``f32`` (``quantized_name``): an existing file is used as it is.
    Written to a temporary name and renamed, so a failure leaves no file.

    Raises:
      ValueError: an unknown ``kind``.
    """
    if kind not in QUANTIZED_TYPES:
        raise ValueError(f"kind must be one of {tuple(QUANTIZED_TYPES)}, got {kind!r}")
    if importlib.util.find_spec("llama_cpp") is None:
        return None, "llama_cpp (llama-cpp-python) is not importable here"
    dest = f32.with_name(quantized_name(f32, kind))
    if dest.is_file():
        return dest, ""
    import ctypes

    import llama_cpp

    tmp = dest.with_name(f"{dest.name}.{os.getpid()}.tmp")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, QUANTIZED_TYPES[kind])
    params.nthread = os.cpu_count() or 1
    logger.info("writing %s from %s (llama.cpp's quantizer, %s)", dest.name, f32.name, kind)
    try:
        code = llama_cpp.llama_model_quantize(str(f32).encode(), str(tmp).encode(),
                                                 ctypes.byref(params))
        if code != 0:
            return None, f"llama_model_quantize({f32}, {kind}) returned {code}"
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest, ""


def gguf_decode_bytes(path: pathlib.Path) -> int:
    """Bytes of the GGUF's tensors a batch-1 decode token reads, as stored (quantized blocks
    with their scales): every tensor, less ``token_embd.weight`` when an ``output.weight``
    (an untied LM head) exists, since then the embedding is only gathered, one row
    (``decode_roofline.weight_bytes``'s rule)."""
    import gguf

    sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}
    untied = "output.weight" in sizes
    return sum(n for name, n in sizes.items() if not (untied and name == "token_embd.weight"))


def run(workload: Workload, *, gguf: pathlib.Path) -> dict[str, Any]:
    """Loads the GGUF, warms up (2 tokens), then generates one request timed.

    Returns ``load_seconds``, ``elapsed`` (s), ``output_tokens``,
    ``output_tokens_per_s``, ``gguf``.

    Raises:
      ValueError: the workload has more than one request.
    """
    if len(workload) != 1:
        raise ValueError(f"the llama.cpp leg runs batch 1 only, got {len(workload)} requests")
    import llama_cpp

    prompt, new = list(workload.prompts[0]), workload.output_lens[0]
    start = time.perf_counter()
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=len(prompt) + new + 16,
                          n_threads=os.cpu_count(), n_batch=512, verbose=False)
    load = time.perf_counter() - start

    def generate(tokens: list[int], n: int) -> int:
        out = 0
        for _ in llm.generate(tokens, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, reset=True):
            out += 1
            if out == n:
                break
        return out

    generate([(t + 1) % llm.n_vocab() for t in prompt], 2)  # warm-up, other tokens
    start = time.perf_counter()
    generated = generate(prompt, new)
    elapsed = time.perf_counter() - start
    return {"load_seconds": load, "elapsed": elapsed, "output_tokens": generated,
            "output_tokens_per_s": generated / elapsed, "gguf": str(gguf),
            "llama_cpp": getattr(llama_cpp, "__version__", "?")}
