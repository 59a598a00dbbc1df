"""``jaxserve.model_files``: which files make a servable model directory (real files, no model)."""

from __future__ import annotations

import pytest

from jaxserve.model_files import check_model_files, missing_model_files


def _touch(directory, *names):
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        (directory / name).write_bytes(b"")
    return directory


@pytest.mark.parametrize("tokenizer_files", [
    ("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"), ("vocab.txt",)])
def test_any_tokenizer_form_with_safetensors_is_complete(tmp_path, tokenizer_files):
    model = _touch(tmp_path / "m", "config.json", "model-00001-of-00002.safetensors",
                   *tokenizer_files)
    assert missing_model_files(model) == []
    check_model_files(model)


def test_half_a_tokenizer_and_unreadable_weights_are_named(tmp_path):
    model = _touch(tmp_path / "m", "config.json", "vocab.json", "pytorch_model.bin",
                   "model.gguf")
    assert missing_model_files(model) == [
        "the weights (*.safetensors; found model.gguf, pytorch_model.bin, which jaxserve "
        "cannot read)",
        "the tokenizer (one of tokenizer.json, tokenizer.model, vocab.json + merges.txt, "
        "vocab.txt)"]
    with pytest.raises(FileNotFoundError) as err:
        check_model_files(model)
    assert "\n" not in str(err.value) and str(model) in str(err.value)


def test_a_separate_tokenizer_directory_is_checked_instead(tmp_path):
    model = _touch(tmp_path / "m", "config.json", "model.safetensors")
    tokenizer = _touch(tmp_path / "t", "tokenizer.json")
    assert missing_model_files(model, tokenizer) == []
    assert missing_model_files(model, tmp_path / "m") != []
    empty = _touch(tmp_path / "e")
    assert missing_model_files(model, empty) == [
        f"the tokenizer in {str(empty)!r} (one of tokenizer.json, tokenizer.model, "
        f"vocab.json + merges.txt, vocab.txt)"]
