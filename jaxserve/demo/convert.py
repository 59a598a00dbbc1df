"""GGUF file → Hugging Face model directory, written and then checked.

Writes ``config.json``, ``generation_config.json``, ``model.safetensors``
(float32, HF Llama names, tied embeddings stored once as
``model.embed_tokens.weight``), ``tokenizer.json``, ``tokenizer_config.json``,
``special_tokens_map.json`` and ``gguf_source.json`` (the GGUF file converted, by
relative path, size and sha256: ``jaxserve.model.gguf_source``, from which an int4
load takes the Q4_1 kernels as stored). The checks re-read what was written: every
safetensors tensor equal to the converted array, the config through
``transformers.AutoConfig``, and the tokenizer through
``transformers.AutoTokenizer`` (ids equal to the ``tokenizers`` object built
here, exact decode round trip, special token ids, chat template markers).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import time
from typing import Any

import numpy as np

from jaxserve.demo import DemoModelError
from jaxserve.demo.gguf_read import GgufModelInfo, generation_config, hf_config, read_model_info
from jaxserve.demo.tensors import convert_tensors
from jaxserve.demo.tokenizer import build_tokenizer, special_tokens_map, tokenizer_config
from jaxserve.model.gguf_source import write_gguf_source

logger = logging.getLogger(__name__)

# Texts whose encode → decode must give back the text exactly (build-time check).
ROUND_TRIP_TEXTS = (
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x ** 2  # square\n",
    "Pi is 3.14159265358979 and 2**10 = 1024.",
    "emoji 🙂🚀 and accents: café, naïve, Ωμέγα",
    "中文字符和日本語のテキスト",
    "tabs\tand   runs of    spaces\n\n\nnewlines ",
    "<|im_start|>user\nHi<|im_end|>\n",
)


@dataclasses.dataclass(frozen=True, slots=True)
class ConversionReport:
    """What ``convert_gguf`` wrote. ``seconds``: wall-clock time of conversion plus checks."""

    seconds: float
    num_tensors: int
    num_parameters: int
    safetensors_bytes: int
    info: GgufModelInfo


def _write_json(path: pathlib.Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf(gguf_path: pathlib.Path, out_dir: pathlib.Path, *,
                 progress: bool | None = None) -> ConversionReport:
    """Convert ``gguf_path`` into the empty directory ``out_dir`` and check the result.

    ``progress``: show tqdm bars (None: on a terminal only). Raises
    ``DemoModelError`` when the file is unsupported or a check fails.
    """
    from gguf import GGUFReader
    from safetensors.numpy import save_file

    start = time.perf_counter()
    reader = GGUFReader(str(gguf_path))
    info = read_model_info(reader)
    tensors = convert_tensors(reader, info, progress=progress)
    _write_json(out_dir / "config.json", hf_config(info))
    _write_json(out_dir / "generation_config.json", generation_config(info))
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer = build_tokenizer(info)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(info))
    _write_json(out_dir / "special_tokens_map.json", special_tokens_map(info))
    write_gguf_source(out_dir, gguf_path, reader=reader)
    check_safetensors(out_dir / "model.safetensors", tensors)
    check_config(out_dir, info)
    check_tokenizer(out_dir, info, tokenizer)
    return ConversionReport(
        seconds=time.perf_counter() - start,
        num_tensors=len(tensors),
        num_parameters=sum(int(t.size) for t in tensors.values()),
        safetensors_bytes=(out_dir / "model.safetensors").stat().st_size,
        info=info,
    )


def check_safetensors(path: pathlib.Path, expected: dict[str, np.ndarray]) -> None:
    """Re-read ``path``: same names, float32, same shapes and bit-identical values as ``expected``."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        names = set(f.keys())
        if names != set(expected):
            raise DemoModelError(f"{path} holds {sorted(names ^ set(expected))[:3]}… unexpectedly")
        for name, want in expected.items():
            got = f.get_tensor(name)
            if got.dtype != np.float32 or got.shape != want.shape or not np.array_equal(got, want):
                raise DemoModelError(f"{path}: {name} reads back as {got.dtype}{list(got.shape)}, "
                                     f"not the written f32{list(want.shape)}")


def check_config(model_dir: pathlib.Path, info: GgufModelInfo) -> None:
    """``transformers.AutoConfig`` reads the architecture numbers of ``info`` back from ``model_dir``."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    got = (config.model_type, config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
           config.num_key_value_heads, config.head_dim, config.vocab_size, config.tie_word_embeddings)
    want = ("llama", info.num_layers, info.hidden_size, info.num_heads, info.num_kv_heads, info.head_dim,
            info.vocab_size, info.tie_word_embeddings)
    if got != want:
        raise DemoModelError(f"config.json reads back as {got}, expected {want}")


def check_tokenizer(model_dir: pathlib.Path, info: GgufModelInfo, built: Any) -> None:
    """The directory's tokenizer, loaded by ``transformers.AutoTokenizer``, matches ``built`` and round-trips."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(model_dir))
    for text in ROUND_TRIP_TEXTS:
        ids = hf.encode(text, add_special_tokens=True)
        if ids != built.encode(text).ids:
            raise DemoModelError(f"AutoTokenizer and the built tokenizer disagree on {text!r}")
        if hf.decode(ids) != text:
            raise DemoModelError(f"tokenizer round trip changed {text!r} into {hf.decode(ids)!r}")
    for name in ("bos", "eos", "unk", "pad"):
        want = getattr(info, f"{name}_token_id")
        if getattr(hf, f"{name}_token_id") != want:
            raise DemoModelError(f"{name}_token_id is {getattr(hf, f'{name}_token_id')}, GGUF says {want}")
    if info.chat_template:
        rendered = hf.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                          add_generation_prompt=True)
        ids = hf.encode(rendered, add_special_tokens=False)
        start_id = hf.convert_tokens_to_ids("<|im_start|>")
        if "<|im_start|>" in info.chat_template and ids.count(start_id) != rendered.count("<|im_start|>"):
            raise DemoModelError(f"chat template markers are not single tokens in {rendered!r}")
