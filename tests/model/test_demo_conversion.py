"""The demo model conversion (GGUF → HF directory) against independent oracles.

Oracles: transformers' own GGUF loader (tensors, tokenizer, chat template),
the GGUF metadata read directly with ``gguf.GGUFReader`` (config numbers),
llama.cpp's rotary convention written out in NumPy (q/k un-permutation), and a
transformers float32 forward on the converted directory (greedy answer).
The transformers GGUF model is loaded once per module (about 17 s). Cache,
CLI and error-path behaviour is in ``test_demo_model_cache.py``.
"""

from __future__ import annotations

import json
import random
import string

import numpy as np
import pytest

from jaxserve.demo.tensors import unpermute_rotary_rows

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SPECIAL_TEXTS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<file_sep>"]
FIXED_TEXTS = [
    "Hello, world!", "The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { sum += a[i]; }",
    "Call 555-0123 or pay $1,234.56 by 2024-12-31; 3.14159e-10", "0 00 000 1234567890",
    "emoji 🙂🚀👩‍💻 flags 🇫🇷", "中文字符和日本語のテキスト、한국어",
    "Ωμέγα, café, naïve, Zürich",
    "   leading", "trailing   ", "tabs\t\tand\n\n\nnewlines\r\n", "  \u00a0 \u3000 ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", "x<|im_end|>y<|endoftext|>",
    "", " ", "a",
]
# Non-ASCII numeric characters (Unicode category N): "smollm" pre-tokenization isolates each one.
NUMERICS = "²³¹¼½¾٠١٢٣٤٥٦٧٨٩०१२३ⅫⅣ①⑦〇"


def _random_texts(seed: int, count: int, *, numerics: bool) -> list[str]:
    """Seeded random strings mixing ASCII, code, digits, whitespace runs, CJK, emoji and special tokens."""
    rng = random.Random(seed)
    pools = [string.ascii_letters + string.punctuation + "  ", string.digits, " \t\n\r\u00a0\u3000",
             [chr(c) for c in range(0x4E00, 0x4F00)], [chr(c) for c in range(0x1F600, 0x1F650)],
             [chr(c) for c in range(0xC0, 0x17F)]]
    if numerics:
        pools.append(NUMERICS)
    texts = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 12)):
            if rng.random() < 0.1:
                parts.append(rng.choice(SPECIAL_TEXTS))
            else:
                pool = rng.choice(pools)
                parts.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 8))))
        texts.append("".join(parts))
    return texts


@pytest.fixture(scope="module")
def gguf_reader(demo_gguf_path):
    import gguf

    return gguf.GGUFReader(str(demo_gguf_path))


@pytest.fixture(scope="module")
def gguf_tokenizer(demo_gguf_path):
    return transformers.AutoTokenizer.from_pretrained(str(demo_gguf_path.parent), gguf_file=demo_gguf_path.name)


@pytest.fixture(scope="module")
def demo_tokenizer(demo_model_dir):
    return transformers.AutoTokenizer.from_pretrained(str(demo_model_dir))


@pytest.fixture(scope="module")
def gguf_model(demo_gguf_path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(demo_gguf_path.parent), gguf_file=demo_gguf_path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_model(demo_model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(str(demo_model_dir), dtype=torch.float32).eval()


# ---------------------------------------------------------------- tensors and config

def test_tensors_equal_transformers_gguf_loader(demo_model_dir, gguf_model):
    """Every tensor bit-identical (tolerance 0) to transformers' GGUF loader's; embeddings tied in both."""
    from safetensors.numpy import load_file

    ours = load_file(str(demo_model_dir / "model.safetensors"))
    theirs = {k: v.detach().numpy() for k, v in gguf_model.state_dict().items()}
    assert set(ours) == set(theirs) - {"lm_head.weight"}
    assert gguf_model.lm_head.weight.data_ptr() == gguf_model.model.embed_tokens.weight.data_ptr()
    for name, want in theirs.items():
        if name != "lm_head.weight":
            assert ours[name].dtype == np.float32 and ours[name].shape == want.shape, name
            np.testing.assert_array_equal(ours[name], want, err_msg=name)


def _rope_interleaved(v: np.ndarray, pos: int, base: float) -> np.ndarray:
    """llama.cpp's (GGML NORM) rotary embedding: rotates pairs (v[2i], v[2i+1]) of each head. v: [heads, H]."""
    half = v.shape[-1] // 2
    angle = pos * base ** (-2.0 * np.arange(half) / v.shape[-1])  # [H/2]
    even, odd = v[:, 0::2], v[:, 1::2]
    out = np.empty_like(v)
    out[:, 0::2] = even * np.cos(angle) - odd * np.sin(angle)
    out[:, 1::2] = even * np.sin(angle) + odd * np.cos(angle)
    return out


def _rope_halves(v: np.ndarray, pos: int, base: float) -> np.ndarray:
    """Hugging Face's rotary embedding (rotate_half): rotates pairs (v[i], v[i + H/2]). v: [heads, H]."""
    half = v.shape[-1] // 2
    angle = pos * base ** (-2.0 * np.arange(half) / v.shape[-1])  # [H/2]
    first, second = v[:, :half], v[:, half:]
    return np.concatenate([first * np.cos(angle) - second * np.sin(angle),
                           first * np.sin(angle) + second * np.cos(angle)], axis=-1)


def test_unpermuted_qk_give_llama_cpp_attention_scores(gguf_reader):
    """HF rotary on un-permuted q/k weights gives the scores llama.cpp's rotary gives on the raw GGUF weights."""
    from gguf.quants import dequantize

    fields = gguf_reader.fields
    n_heads = int(fields["llama.attention.head_count"].contents())
    n_kv = int(fields["llama.attention.head_count_kv"].contents())
    base = float(fields["llama.rope.freq_base"].contents())
    raw = {t.name: dequantize(t.data, t.tensor_type).astype(np.float64) for t in gguf_reader.tensors
           if t.name in ("blk.5.attn_q.weight", "blk.5.attn_k.weight")}
    wq, wk = raw["blk.5.attn_q.weight"], raw["blk.5.attn_k.weight"]  # [N*H, D], [K*H, D]
    rng = np.random.default_rng(0)
    xq, xk = rng.standard_normal(wq.shape[1]), rng.standard_normal(wq.shape[1])  # [D]
    pq, pk = 37, 11
    group = n_heads // n_kv

    def scores(q_w, k_w, rope):  # -> [N] one query-key score per query head
        q = rope((q_w @ xq).reshape(n_heads, -1), pq)  # [N, H]
        k = rope((k_w @ xk).reshape(n_kv, -1), pk)  # [K, H]
        return np.einsum("nh,nh->n", q, np.repeat(k, group, axis=0))

    want = scores(wq, wk, lambda v, p: _rope_interleaved(v, p, base))
    got = scores(unpermute_rotary_rows(wq, n_heads), unpermute_rotary_rows(wk, n_kv),
                 lambda v, p: _rope_halves(v, p, base))
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)
    # Negative control: without un-permuting, HF's rotary gives different scores.
    wrong = scores(wq, wk, lambda v, p: _rope_halves(v, p, base))
    assert np.max(np.abs(wrong - want)) > 1e-3 * np.max(np.abs(want))


def test_unpermute_inverts_llama_cpp_permute():
    """Inverse of convert_hf_to_gguf.py's permute: reshape(n, 2, H/2, D).swapaxes(1, 2)."""
    rng = np.random.default_rng(1)
    for n_heads, head_dim in [(9, 64), (3, 64), (2, 8)]:
        w = rng.standard_normal((n_heads * head_dim, 24)).astype(np.float32)  # HF layout [N*H, D]
        permuted = w.reshape(n_heads, 2, head_dim // 2, 24).swapaxes(1, 2).reshape(w.shape)
        np.testing.assert_array_equal(unpermute_rotary_rows(permuted, n_heads), w)
    with pytest.raises(ValueError, match="heads of even size"):
        unpermute_rotary_rows(np.ones((9 * 3, 4), np.float32), 9)


def test_config_matches_gguf_metadata(demo_model_dir, gguf_reader):
    fields = gguf_reader.fields

    def meta(key):
        return fields[key].contents()

    config = transformers.AutoConfig.from_pretrained(str(demo_model_dir))
    assert config.architectures == ["LlamaForCausalLM"] and config.model_type == "llama"
    assert config.num_hidden_layers == meta("llama.block_count") == 30
    assert config.hidden_size == meta("llama.embedding_length") == 576
    assert config.num_attention_heads == meta("llama.attention.head_count") == 9
    assert config.num_key_value_heads == meta("llama.attention.head_count_kv") == 3
    assert config.head_dim == meta("llama.rope.dimension_count") == 64
    assert config.intermediate_size == meta("llama.feed_forward_length")
    assert config.vocab_size == len(meta("tokenizer.ggml.tokens")) == 49152
    assert config.max_position_embeddings == meta("llama.context_length")
    assert config.tie_word_embeddings is True
    assert all(t.name != "output.weight" for t in gguf_reader.tensors)
    assert config.rms_norm_eps == pytest.approx(meta("llama.attention.layer_norm_rms_epsilon"), rel=1e-6)
    rope_theta = getattr(config, "rope_parameters", None) or {"rope_theta": config.rope_theta}
    assert rope_theta["rope_theta"] == meta("llama.rope.freq_base")
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (
        meta("tokenizer.ggml.bos_token_id"), meta("tokenizer.ggml.eos_token_id"),
        meta("tokenizer.ggml.padding_token_id"))
    raw = json.loads((demo_model_dir / "config.json").read_text())
    assert raw["rope_theta"] == meta("llama.rope.freq_base")  # top level: what transformers 4.5x reads


# ---------------------------------------------------------------- tokenizer and chat template

def _llama_cpp_smollm_encode(gguf_tokenizer, text: str) -> list[int]:
    """llama.cpp's "smollm" pre-tokenization, then transformers' GGUF tokenizer on each piece.

    llama.cpp first isolates every \\p{N} character, then applies the GPT-2 regex to
    what is left; transformers' GGUF loader skips the first step (it ignores
    ``tokenizer.ggml.pre``), so cutting the text at each \\p{N} character before
    handing it over gives llama.cpp's result. Special tokens hold no digits, so
    they are never cut.
    """
    import regex

    pieces = [p for p in regex.split(r"(\p{N})", text) if p]
    return [i for piece in pieces for i in gguf_tokenizer.encode(piece, add_special_tokens=False)]


def _check_decode(demo_tokenizer, gguf_tokenizer, ids: list[int], text: str) -> None:
    assert demo_tokenizer.decode(ids) == gguf_tokenizer.decode(ids) == text
    assert demo_tokenizer.decode(ids, skip_special_tokens=True) == gguf_tokenizer.decode(
        ids, skip_special_tokens=True), text


def test_tokenizer_equals_transformers_gguf_tokenizer(demo_tokenizer, gguf_tokenizer):
    """Direct equality on texts without \\p{N} characters (ASCII, code, emoji, CJK, whitespace runs, specials).

    On those the "smollm" digit rule is a no-op; texts with digits are compared in
    the next test.
    """
    import regex

    texts = [t for t in FIXED_TEXTS + _random_texts(seed=1234, count=300, numerics=False)
             if not regex.search(r"\p{N}", t)]
    assert len(texts) > 100
    for text in texts:
        ids = demo_tokenizer.encode(text)
        assert ids == gguf_tokenizer.encode(text), text
        assert demo_tokenizer.encode(text, add_special_tokens=False) == ids  # no BOS/EOS added
        _check_decode(demo_tokenizer, gguf_tokenizer, ids, text)
    for name in ("bos", "eos", "unk", "pad"):
        assert getattr(demo_tokenizer, f"{name}_token_id") == getattr(gguf_tokenizer, f"{name}_token_id"), name
    assert set(demo_tokenizer.all_special_ids) == set(gguf_tokenizer.all_special_ids)
    assert demo_tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]
    assert len(demo_tokenizer) == len(gguf_tokenizer) == 49152


def test_tokenizer_isolates_numerics_like_llama_cpp(demo_tokenizer, gguf_tokenizer):
    """Every text, digits included, tokenizes as llama.cpp's "smollm" pre-tokenizer says.

    transformers' GGUF tokenizer alone differs where whitespace runs or a space
    precede a number: "  7" is ["ĠĠ", "7"] for llama.cpp (and here) but
    ["Ġ", "Ġ", "7"] there; " ²" is ["Ġ", "Â²"] here but ["ĠÂ", "²"] there.
    """
    texts = (["  7", "\n\n7", " ²", "x ½ y", "٣٤ and ٥"] + FIXED_TEXTS
             + _random_texts(seed=1234, count=300, numerics=False)
             + _random_texts(seed=99, count=200, numerics=True))
    for text in texts:
        want = _llama_cpp_smollm_encode(gguf_tokenizer, text)
        assert demo_tokenizer.encode(text) == want, text
        _check_decode(demo_tokenizer, gguf_tokenizer, want, text)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_gguf(demo_tokenizer, gguf_tokenizer, add_generation_prompt):
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 🙂"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2? 中文"}],
    ]
    for messages in conversations:
        ours = demo_tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
        theirs = gguf_tokenizer.apply_chat_template(messages, tokenize=False,
                                                    add_generation_prompt=add_generation_prompt)
        assert ours == theirs
        assert ours.startswith("<|im_start|>") and ours.endswith(
            "<|im_start|>assistant\n" if add_generation_prompt else "<|im_end|>\n")
        assert demo_tokenizer.encode(ours, add_special_tokens=False) == gguf_tokenizer.encode(
            theirs, add_special_tokens=False)


# ---------------------------------------------------------------- the model runs

def test_forward_matches_gguf_model_and_answers_paris(demo_tokenizer, hf_model, gguf_model):
    """Float32 logits equal the GGUF-loaded model's (atol 1e-5: same weights, same code); greedy answer: Paris."""
    prompt = demo_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([demo_tokenizer.encode(prompt, add_special_tokens=False)])  # [1, T]
    with torch.no_grad():
        ours, theirs = hf_model(ids).logits, gguf_model(ids).logits  # [1, T, V] f32
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    answer = demo_tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer
