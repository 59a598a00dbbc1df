"""The engine's command-line flags: ``--token-buckets`` and the demo's two-rung T ladder."""

from __future__ import annotations

import argparse

import pytest

from jaxserve.commands import demo
from jaxserve.engine.service import add_engine_arguments, engine_config, engine_flags


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser.parse_args(argv)


def test_token_buckets_reach_the_scheduler_and_the_engine_process():
    args = _parse("--max-num-batched-tokens", "64", "--token-buckets", "1,16,64")
    assert engine_config(args).scheduler.token_buckets == (1, 16, 64)
    flags = engine_flags(args)
    assert flags[flags.index("--token-buckets") + 1] == "1,16,64"
    assert engine_config(_parse(*flags)).scheduler.token_buckets == (1, 16, 64)


def test_without_token_buckets_the_default_ladder():
    args = _parse("--max-num-batched-tokens", "64")
    assert "--token-buckets" not in engine_flags(args)
    assert engine_config(args).scheduler.token_buckets == (1, 4, 8, 16, 32, 64)


def test_bad_token_buckets_are_refused():
    with pytest.raises(SystemExit):
        _parse("--token-buckets", "1,x")
    with pytest.raises(ValueError, match="token_buckets must reach 64"):
        engine_config(_parse("--max-num-batched-tokens", "64", "--token-buckets", "1,32"))


def test_the_demo_ladder_is_decode_and_the_budget():
    assert demo.demo_token_buckets(64) == (1, 64)
    assert demo.demo_token_buckets(1) == (1,)
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args([])
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.token_buckets) == (1, 64, ())


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("flag", ["--quantization", "-q"])
def test_quantization_reaches_the_engine_process_and_the_worker(flag, method):
    args = _parse(flag, method)
    config = engine_config(args)
    assert config.quantization == method and config.worker_init().quantization == method
    assert engine_config(_parse(*engine_flags(args))).quantization == method
    default = _parse()
    assert "--quantization" not in engine_flags(default)
    assert engine_config(default).quantization is None
    assert engine_config(default).worker_init().quantization is None
    with pytest.raises(SystemExit):  # argparse: "invalid choice", exit 2
        _parse(flag, "awq")


@pytest.mark.parametrize("value", ["fp8", "fp8_e4m3"])
def test_kv_cache_dtype_reaches_the_engine_process_and_the_worker(value):
    args = _parse("--kv-cache-dtype", value)
    config = engine_config(args)
    assert config.cache.kv_cache_dtype == value
    assert config.worker_init().kv_cache_dtype == value
    assert engine_config(_parse(*engine_flags(args))).cache.kv_cache_dtype == value
    default = _parse()
    assert "--kv-cache-dtype" not in engine_flags(default)
    assert engine_config(default).worker_init().kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):  # argparse: "invalid choice", exit 2
        _parse("--kv-cache-dtype", "fp8_e5m2")


@pytest.mark.parametrize("bad", ["FP8", "INT8", "gptq", ""])
def test_engine_config_refuses_an_unsupported_quantization_in_one_line(bad):
    from jaxserve.engine.config import EngineConfig

    with pytest.raises(ValueError, match=r"^quantization must be one of None, 'int8', 'int4', 'fp8'; got ") as err:
        EngineConfig(quantization=bad)
    assert "\n" not in str(err.value)


def test_speculative_config_reaches_the_engine_process():
    args = _parse("--speculative-config",
                  '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    spec = engine_config(args).speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min,
            spec.prompt_lookup_max) == ("ngram", 4, 3, 3)
    assert engine_config(_parse(*engine_flags(args))).speculative_config == spec
    assert "--speculative-config" not in engine_flags(_parse())
    assert engine_config(_parse()).speculative_config is None


def test_a_draft_model_flag_reaches_the_worker_with_its_directory_checked(tmp_path, monkeypatch):
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    monkeypatch.setenv("HOME", str(tmp_path))
    args = _parse("--speculative-config", '{"model": "~/draft", "num_speculative_tokens": 2}')
    spec = engine_config(args).speculative_config
    assert (spec.method, spec.model, spec.num_speculative_tokens) == (
        "draft_model", str(draft), 2)  # ~ expanded, absolute
    assert engine_config(_parse(*engine_flags(args))).speculative_config == spec
    init = engine_config(args).worker_init()
    assert (init.draft_model, init.num_speculative_tokens) == (str(draft), 2)
    # k is capped by the R ladder's top less the sequence's own slot: 4 rows, 3 drafts
    args = _parse("--max-num-seqs", "4", "--speculative-config",
                  f'{{"model": "{draft}", "num_speculative_tokens": 50}}')
    assert engine_config(args).worker_init().num_speculative_tokens == 3


@pytest.mark.parametrize("model, why", [
    ("/nonexistent/draft", "speculative_config model: model '/nonexistent/draft' is not a "
                           "directory"),
    ("", "speculative_config model is empty"),
    ("FILE", "is not a directory"),
    ("NOCONFIG", "has no config.json"),
])
def test_a_bad_draft_model_directory_is_refused_by_argparse(model, why, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    model = {"FILE": str(tmp_path / "file"), "NOCONFIG": str(tmp_path)}.get(model, model)
    with pytest.raises(SystemExit):
        _parse("--speculative-config", f'{{"model": "{model}"}}')
    err = capsys.readouterr().err
    assert "--speculative-config" in err and why in err and "Traceback" not in err


def test_prefix_caching_takes_vllms_flags_too():
    assert engine_config(_parse()).cache.enable_prefix_caching
    assert engine_config(_parse("--enable-prefix-caching")).cache.enable_prefix_caching
    for flag in ("--no-prefix-caching", "--no-enable-prefix-caching"):
        args = _parse(flag)
        assert not engine_config(args).cache.enable_prefix_caching
        assert not engine_config(_parse(*engine_flags(args))).cache.enable_prefix_caching


@pytest.mark.parametrize("bad, why", [
    ("{not json", "invalid JSON (Expecting property name"), ("[1]", "a JSON object is needed"),
    ('{"method": "ngram", "num_speculative_tokens": 2.5}', "must be an integer, got 2.5"),
    ('{"num_speculative_tokens": 3}', "needs a method"),
    ('{"method": "eagle"}', "method must be one of ngram, draft_model"),
    ('{"method": "draft_model"}', "is needed with method draft_model"),
    ('{"method": "draft-model", "model": "/m"}', "method must be one of ngram, draft_model"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be >= 1"),
    ('{"draft_model": "x"}', "unknown key"),
])
def test_a_bad_speculative_config_is_refused_by_argparse_naming_the_cause(bad, why, capsys):
    with pytest.raises(SystemExit):
        _parse("--speculative-config", bad)
    err = capsys.readouterr().err
    assert "--speculative-config" in err and why in err


def test_a_cache_too_small_for_one_sequence_names_the_flags_to_change():
    from jaxserve.engine.config import EngineConfig
    from jaxserve.step_plan import Geometry

    geometry = Geometry(num_kv_blocks=2, block_size=16, max_model_len=8192, vocab_size=256,
                        eos_token_ids=(0,))
    with pytest.raises(ValueError) as err:
        EngineConfig(model="/m").resolved(geometry)
    message = str(err.value)
    assert message.startswith("the KV cache holds 16 tokens (1 usable block(s) of 16)")
    for flag in ("--num-kv-blocks", "--kv-cache-bytes", "--max-model-len", "num_kv_blocks"):
        assert flag in message
    fits = Geometry(num_kv_blocks=513, block_size=16, max_model_len=8192, vocab_size=256,
                    eos_token_ids=(0,))
    assert EngineConfig(model="/m").resolved(fits).cache.num_kv_blocks == 513
