"""The CLI's user errors: one line on stderr and a non-zero status, never a traceback.

No server runs here: the errors are caught before any is needed (``chat``
validates its sampling flags up front; ``serve`` checks the model path, its
files, ``--dtype`` and the engine's limits and bucket ladders before it
starts a process), or no server answers (the
client commands then say how to start one). Also: a misspelt flag prints the
subcommand's usage, ``serve --help`` names both APIs and their ports, and the start-up notices of transformers and JAX that are
not problems stay quiet.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

UNREACHABLE = "127.0.0.1:9"  # the discard port on loopback: connecting is refused at once


def _cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxserve", *args], input=stdin,
                          capture_output=True, text=True, timeout=120)


def test_chat_refuses_bad_sampling_flags_before_the_first_message():
    proc = _cli("chat", "--server", "127.0.0.1:9", "--temperature", "-1", stdin="Hi\n")
    assert proc.returncode == 2, proc.stderr
    assert "temperature" in proc.stderr and "Traceback" not in proc.stderr
    assert "assistant>" not in proc.stdout


def test_chat_exits_non_zero_when_a_reply_failed():
    proc = _cli("chat", "--server", "127.0.0.1:9", "--timeout", "5", stdin="Hi\n")
    assert proc.returncode == 1, proc.stderr
    assert "error: UNAVAILABLE" in proc.stderr and "Traceback" not in proc.stderr


def test_serve_with_a_missing_model_directory_fails_in_one_line(tmp_path):
    proc = _cli("serve", "--model", str(tmp_path / "missing"), "--port", "0")
    assert proc.returncode == 1, proc.stderr
    assert "missing" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("flags, named", [
    (("--token-buckets", "16,8,4000"), "token_buckets"),
    (("--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--token-buckets", "16,32"),
     "token_buckets"),  # does not reach the step budget
])
def test_serve_refuses_bad_engine_flags_before_starting_a_process(flags, named):
    proc = _cli("serve", "--port", "0", *flags)
    assert proc.returncode == 2, proc.stderr
    assert named in proc.stderr and "Traceback" not in proc.stderr
    assert "starting" not in proc.stderr  # no process was launched


@pytest.mark.parametrize("flags, named", [
    (("--enable-auto-tool-choice",), "--tool-call-parser"),  # vLLM refuses it too
    (("--tool-call-parser", "qwen"), "invalid choice: 'qwen'"),
])
def test_serve_refuses_auto_tool_choice_without_a_known_parser(flags, named):
    proc = _cli("serve", "--port", "0", *flags)
    assert proc.returncode == 2, proc.stderr
    assert named in proc.stderr and "Traceback" not in proc.stderr
    assert "starting" not in proc.stderr


def test_serve_options_pass_the_tool_call_parser_only_with_auto_tool_choice():
    from jaxserve.cli import build_parser
    from jaxserve.commands.serve import serve_options

    for flags, parser_name in ((["--tool-call-parser", "hermes"], None),
                               (["--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
                                "hermes")):
        args = build_parser().parse_args(["serve", *flags])
        assert serve_options(args).tool_call_parser == parser_name


def _model_dir(tmp_path, demo_model_dir, *, weights: bool, tokenizer: bool):
    """A directory with the demo model's config and, optionally, its weights and tokenizer."""
    model = tmp_path / "model"
    model.mkdir()
    shutil.copy(demo_model_dir / "config.json", model / "config.json")
    if weights:
        (model / "model.safetensors").symlink_to(demo_model_dir / "model.safetensors")
    if tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(demo_model_dir / name, model / name)
    return model


@pytest.mark.parametrize("weights, tokenizer, missing", [
    (True, False, "the tokenizer (one of tokenizer.json"),
    (False, True, "the weights (*.safetensors)"),
    (False, False, "the weights (*.safetensors) and the tokenizer")])
def test_serve_names_missing_model_files_before_starting_anything(tmp_path, demo_model_dir,
                                                                   weights, tokenizer, missing):
    model = _model_dir(tmp_path, demo_model_dir, weights=weights, tokenizer=tokenizer)
    proc = _cli("serve", "--model", str(model), "--port", "0", "--metrics-port", "0")
    assert proc.returncode == 1, proc.stderr
    assert missing in proc.stderr and str(model) in proc.stderr
    assert "Traceback" not in proc.stderr and "starting worker" not in proc.stderr


def test_llm_names_missing_tokenizer_files_before_starting_a_worker(tmp_path, demo_model_dir):
    from jaxserve import LLM

    model = _model_dir(tmp_path, demo_model_dir, weights=True, tokenizer=False)
    with pytest.raises(FileNotFoundError, match=r"lacks the tokenizer \(one of tokenizer.json"):
        LLM(str(model))
    (model / "pytorch_model.bin").write_bytes(b"")
    (model / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="found pytorch_model.bin, which jaxserve cannot"):
        LLM(str(model), tokenizer=str(demo_model_dir))


def test_float16_is_refused_at_start_up(demo_model_dir):
    proc = _cli("serve", "--dtype", "float16", "--port", "0")
    assert proc.returncode == 2, proc.stderr
    assert "usage: jaxserve serve" in proc.stderr and "invalid choice: 'float16'" in proc.stderr
    from jaxserve import LLM

    with pytest.raises(ValueError,
                       match="dtype must be one of float32, bfloat16 or auto, got 'float16'"):
        LLM(str(demo_model_dir), dtype="float16")


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_data_parallel_size_below_one_is_refused_with_the_flags_name(value):
    proc = _cli("serve", "--data-parallel-size", value, "--port", "0")
    assert proc.returncode == 2, proc.stderr
    assert "usage: jaxserve serve" in proc.stderr
    assert "argument --data-parallel-size/-dp:" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_serve_options_refuse_a_data_parallel_size_below_one():
    from jaxserve.launcher import ServeOptions

    assert ServeOptions(data_parallel_size=3).data_parallel_size == 3
    with pytest.raises(ValueError, match="data_parallel_size must be >= 1, got 0"):
        ServeOptions(data_parallel_size=0)


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_with_no_server_the_client_commands_say_how_to_start_one(command):
    args = ["hello"] if command == "generate" else []
    proc = _cli(command, *args, "--server", UNREACHABLE, "--timeout", "5", stdin="Hi\n")
    assert proc.returncode == 1, proc.stderr
    assert "error: UNAVAILABLE" in proc.stderr and "Traceback" not in proc.stderr
    assert f"no jaxserve server answers at {UNREACHABLE}" in proc.stderr
    assert "jaxserve serve --model MODEL_DIR" in proc.stderr


def test_a_misspelt_flag_prints_the_subcommands_usage():
    proc = _cli("generate", "hello", "--tempurature", "0.5")
    assert proc.returncode == 2
    assert "usage: jaxserve generate" in proc.stderr
    assert "unrecognized arguments: --tempurature 0.5" in proc.stderr


_HIDE_TORCH = (
    "import importlib.util\n"
    "real = importlib.util.find_spec\n"
    "importlib.util.find_spec = lambda name, package=None: (\n"
    "    None if name.split('.')[0] == 'torch' else real(name, package))\n")


@pytest.mark.parametrize("notice, code", [
    ("PyTorch was not found", _HIDE_TORCH + "import transformers\ntransformers.AutoTokenizer\n"),
    ("Unable to initialize backend 'tpu'", "import jax\njax.devices()\n")])
def test_start_up_notices_are_quiet(notice, code):
    """Each server process calls setup_logging first; the notice shows without it (control)."""
    def run(quiet: bool) -> str:
        setup = ("from jaxserve.procutil import setup_logging\nsetup_logging('test', 'INFO')\n"
                 if quiet else "import logging\nlogging.basicConfig(level='INFO')\n")
        env = {k: v for k, v in os.environ.items()
               if k not in ("TRANSFORMERS_NO_ADVISORY_WARNINGS", "JAX_PLATFORMS")}
        proc = subprocess.run([sys.executable, "-c", setup + code], capture_output=True,
                              text=True, timeout=120, env=env)
        assert proc.returncode == 0, proc.stderr
        return proc.stderr

    if notice not in run(quiet=False):
        pytest.skip(f"this installation does not print {notice!r}")
    assert notice not in run(quiet=True)


def test_serve_help_names_both_apis_and_their_ports():
    proc = _cli("serve", "--help")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())  # argparse wraps lines
    assert "gRPC" in text and "OpenAI-compatible HTTP API" in text
    for flag in ("--port", "--http-port", "--no-http"):
        assert flag in text
    top = " ".join(_cli("--help").stdout.split())
    assert "serve a model over gRPC" in top and "OpenAI-compatible HTTP API" in top
