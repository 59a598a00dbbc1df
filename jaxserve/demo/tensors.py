"""GGUF tensors → Hugging Face Llama tensors (float32, HF names, HF rotary row order).

Dequantization is the ``gguf`` package's (``gguf.quants.dequantize``). A GGUF
tensor of ``shape [ne0, ne1]`` holds ``ne1`` rows of ``ne0`` values, i.e. the
PyTorch ``nn.Linear`` layout ``[out, in]`` — no transpose is needed.

The one real transformation is on ``attn_q`` / ``attn_k``. llama.cpp's
``convert_hf_to_gguf.py`` (``LlamaModel.permute``) reorders each head's output
rows so that GGML's rotary embedding, which rotates adjacent pairs
``(x[2i], x[2i+1])``, computes what Hugging Face's ``rotate_half`` computes on
the pairs ``(x[i], x[i + H/2])``: HF row ``(head, half, i)`` is stored at GGUF
row ``(head, i, half)``. ``unpermute_rotary_rows`` applies the inverse.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from jaxserve.demo import DemoModelError
from jaxserve.demo.gguf_read import GgufModelInfo

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def hf_tensor_name(gguf_name: str) -> str:
    """HF name of a llama GGUF tensor, e.g. ``blk.3.attn_q.weight`` → ``model.layers.3.self_attn.q_proj.weight``.

    Raises ``DemoModelError`` for a name outside the Llama set.
    """
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise DemoModelError(f"unexpected GGUF tensor {gguf_name!r} for a llama model")
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"


def expected_shapes(info: GgufModelInfo) -> dict[str, tuple[int, ...]]:
    """HF tensor name → shape for the model ``info`` describes (``lm_head`` only when untied)."""
    D, F, V = info.hidden_size, info.intermediate_size, info.vocab_size
    q_rows, kv_rows = info.num_heads * info.head_dim, info.num_kv_heads * info.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not info.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, D)
    for i in range(info.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (D,),
            p + "post_attention_layernorm.weight": (D,),
            p + "self_attn.q_proj.weight": (q_rows, D),
            p + "self_attn.k_proj.weight": (kv_rows, D),
            p + "self_attn.v_proj.weight": (kv_rows, D),
            p + "self_attn.o_proj.weight": (D, q_rows),
            p + "mlp.gate_proj.weight": (F, D),
            p + "mlp.up_proj.weight": (F, D),
            p + "mlp.down_proj.weight": (D, F),
        }
    return shapes


def unpermute_rotary_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: ``[num_heads * H, D]`` GGUF rows → HF rows.

    Within each head, GGUF row ``2 * i + half`` becomes HF row ``half * H/2 + i``
    (``i < H/2``, ``half`` in {0, 1}). ``num_heads`` is N for q_proj and K for
    k_proj. Raises ``ValueError`` when the rows do not split into heads of even size.
    """
    rows = w.shape[0]
    if rows % num_heads or (rows // num_heads) % 2:
        raise ValueError(f"{rows} rows do not split into {num_heads} heads of even size")
    head_dim = rows // num_heads
    # [N, H/2, 2, D] -> [N, 2, H/2, D]
    return w.reshape(num_heads, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_rows(gguf_name: str, rows: np.ndarray, num_heads: int, num_kv_heads: int) -> np.ndarray:
    """A GGUF tensor's rows in HF order: ``attn_q`` / ``attn_k`` un-permuted
    (``unpermute_rotary_rows`` with ``num_heads`` N / ``num_kv_heads`` K), others as they are.

    ``rows`` [out, ...]: axis 0 is the tensor's output rows — its float values ``[out, in]``,
    or its quantized bytes ``[out, bytes per row]`` (blocks run along the input axis, so
    moving whole rows moves whole blocks).
    """
    if gguf_name.endswith(".attn_q.weight"):
        return unpermute_rotary_rows(rows, num_heads)
    if gguf_name.endswith(".attn_k.weight"):
        return unpermute_rotary_rows(rows, num_kv_heads)
    return rows


def convert_tensors(reader: Any, info: GgufModelInfo, progress: bool | None = None) -> dict[str, np.ndarray]:
    """Dequantize every tensor of a ``gguf.GGUFReader`` into float32 HF tensors.

    Returns HF name → C-contiguous ``f32`` array (shapes as ``expected_shapes``).
    ``progress``: tqdm's ``disable`` inverted (None: a bar on a terminal only).
    Raises ``DemoModelError`` on an unknown, missing or misshapen tensor.
    """
    from gguf.quants import dequantize
    from tqdm import tqdm

    shapes = expected_shapes(info)
    out: dict[str, np.ndarray] = {}
    disable = None if progress is None else not progress
    for tensor in tqdm(reader.tensors, desc="dequantize", unit="tensor", disable=disable, leave=False):
        name = hf_tensor_name(tensor.name)
        w = dequantize(tensor.data, tensor.tensor_type)
        gguf_shape = tuple(int(n) for n in reversed(tensor.shape))  # [ne1, ne0] = [out, in]
        if name not in shapes or w.shape != gguf_shape or gguf_shape != shapes[name]:
            raise DemoModelError(f"GGUF tensor {tensor.name} ({tensor.tensor_type.name}) dequantized to "
                                 f"{w.shape}, expected {shapes.get(name)} for {name}")
        w = hf_rows(tensor.name, w, info.num_heads, info.num_kv_heads)
        out[name] = np.ascontiguousarray(w, dtype=np.float32)
    missing = sorted(set(shapes) - set(out))
    if missing:
        raise DemoModelError(f"GGUF file lacks {len(missing)} tensors, e.g. {missing[:3]}")
    return out
