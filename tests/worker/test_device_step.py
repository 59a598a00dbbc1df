"""The device-resident step: explicit transfers only, dispatch ahead, an O(R) payload.

A tiny random-weight Llama (transformers writes it; the worker loads the
safetensors) decodes through ``EngineCore`` + ``InProcessWorker``:

- under ``jax.transfer_guard("disallow")`` every transfer of 50 steady
  decode steps is an explicit one, and they number one upload (the packed
  step buffer) and one download (the sampled tokens) per step — on one
  device and tensor parallel over two (simulated CPU devices);
- with a deliberately slow device step, step N + 1 is dispatched before
  step N's tokens are read, and without waiting for step N to finish;
- the upload's bytes grow with R, not with the context length nor with
  ``max_num_seqs``.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.engine import CacheConfig, EngineConfig, EngineCore, EngineCoreRequest, SchedulerConfig
from jaxserve.engine.config import CompileConfig, SpeculativeConfig
from jaxserve.model.loader import load_model
from jaxserve.model.sharding import make_mesh
from jaxserve.sampling_params import SamplingParams
from jaxserve.step_plan import NewRow, StepPlan
from jaxserve.worker import InProcessWorker
from jaxserve.worker import transfers
from jaxserve.worker import model_runner as mr
from tests.model.hf_tiny import make_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_llama")
    make_tiny_model("LlamaForCausalLM", directory, seed=3)
    return directory


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(tiny_dir, "float32")


@pytest.fixture(scope="module")
def tiny_tp2(tiny_dir):
    return load_model(tiny_dir, "float32", mesh=make_mesh(2))


def _engine(loaded, *, max_num_seqs=8, max_model_len=256, async_scheduling=True,
            precompile=True, request_buckets=(1, 2, 4, 8), token_buckets=(8, 16, 64),
            tensor_parallel_size=1, speculative_config=None):
    config = EngineConfig(
        max_model_len=max_model_len, seed=1, async_scheduling=async_scheduling,
        speculative_config=speculative_config,
        tensor_parallel_size=tensor_parallel_size,
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                                  token_buckets=token_buckets, request_buckets=request_buckets),
        cache=CacheConfig(block_size=4, num_kv_blocks=max_num_seqs * max_model_len // 4 + 1),
        compile=CompileConfig(strict_recompile=True, precompile=precompile))
    return EngineCore(config, InProcessWorker(loaded, progress=False))


def _start(engine, num_requests, prompt_len=5, sampling=None):
    rng = np.random.default_rng(0)
    for i in range(num_requests):
        prompt = rng.integers(1, 200, prompt_len).tolist()
        sp = sampling or SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.0)
        engine.add_request(EngineCoreRequest(f"r{i}", prompt, sp))
    # Prefill until every request has decoded, then two more steps: a steady decode.
    decoded: set[str] = set()
    while len(decoded) < num_requests:
        decoded.update(out.request_id for out in engine.step() if out.new_token_ids)
    for _ in range(2):
        engine.step()


class _Transfers:
    """Counts the worker's explicit uploads / downloads and the bytes uploaded."""

    def __init__(self, monkeypatch):
        self.uploads, self.downloads, self.upload_bytes = 0, 0, []
        real_upload, real_fetch = transfers.upload, transfers.fetch

        def upload(tree, placement=None):
            self.uploads += 1
            self.upload_bytes.append(sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree)))
            return real_upload(tree, placement)

        def fetch(tree):
            self.downloads += 1
            return real_fetch(tree)

        monkeypatch.setattr(transfers, "upload", upload)
        monkeypatch.setattr(transfers, "fetch", fetch)


@pytest.mark.parametrize("sampling", [
    SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.0),
    SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.8, top_p=0.9, seed=4,
                   repetition_penalty=1.2),
], ids=["greedy", "penalized"])
@pytest.mark.parametrize("tp", [1, 2], ids=["one-device", "tp2"])
def test_steady_decode_makes_one_upload_and_one_download_per_step(request, monkeypatch,
                                                                  sampling, tp):
    loaded = request.getfixturevalue("tiny" if tp == 1 else "tiny_tp2")
    engine = _engine(loaded, tensor_parallel_size=tp)
    _start(engine, 6, sampling=sampling)
    transfers = _Transfers(monkeypatch)
    steps, tokens = 50, 0
    with jax.transfer_guard("disallow"):
        for _ in range(steps):
            tokens += sum(len(out.new_token_ids) for out in engine.step())
    assert tokens == steps * 6
    assert transfers.uploads == steps and transfers.downloads == steps
    assert engine.worker.guard.num_recompiles == 0
    engine.shutdown()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_steady_speculative_step_makes_one_upload_and_one_download(tiny, tiny_dir, monkeypatch,
                                                                     method):
    """Drafts travel in the step's buffer; the kept slots (and a draft model's proposals
    for the next step) come back with the tokens."""
    spec = (SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=2)
            if method == "ngram" else
            SpeculativeConfig(method="draft_model", model=str(tiny_dir), num_speculative_tokens=2))
    engine = _engine(tiny, speculative_config=spec)
    _start(engine, 3)
    transfers = _Transfers(monkeypatch)
    steps, tokens = 30, 0
    before = engine.stats().spec_decode_num_draft_tokens
    with jax.transfer_guard("disallow"):
        for _ in range(steps):
            tokens += sum(len(out.new_token_ids) for out in engine.step())
    assert engine.stats().spec_decode_num_draft_tokens > before  # drafts were verified
    assert tokens >= steps * 3
    assert transfers.uploads == steps and transfers.downloads == steps
    assert engine.worker.guard.num_recompiles == 0
    engine.shutdown()


def test_an_implicit_transfer_in_the_step_is_caught(tiny, monkeypatch):
    """The guard is live: a NumPy array handed to the step is refused."""
    engine = _engine(tiny)
    _start(engine, 2)
    monkeypatch.setattr(transfers, "upload", lambda tree, placement=None: tree)  # no copy
    with jax.transfer_guard("disallow"), pytest.raises(Exception, match="[Dd]isallowed"):
        engine.step()


def _busy(x: jax.Array) -> jax.Array:
    """``x`` after ~a few hundred ms of device work (a chain of matmuls XLA cannot drop)."""
    z = jnp.ones((1200, 1200), jnp.float32)
    for _ in range(4):
        z = z @ z / 1200.0
    return jnp.where(z[0, 0] == z[0, 0], x, -x)  # false only for NaN


def test_step_n_plus_1_is_dispatched_before_step_n_is_read(tiny, monkeypatch):
    busy = jax.jit(_busy)
    probe = jnp.ones(4)
    busy(probe).block_until_ready()
    start = time.perf_counter()
    busy(probe).block_until_ready()
    delay = time.perf_counter() - start  # the device time the slow step adds, seconds
    engine = _engine(tiny, precompile=False)  # the slowed body compiles on first use
    _start(engine, 2)
    real_body = mr.run_body

    def slow_body(*args, **kwargs):
        kv_cache, block_table, hidden, slots, hidden_all = real_body(*args, **kwargs)
        return kv_cache, block_table, _busy(hidden), slots, hidden_all

    monkeypatch.setattr(mr, "run_body", jax.jit(
        slow_body, static_argnums=0, static_argnames=("layout", "backend"),
        donate_argnames=("kv_cache", "block_table")))
    events = []
    real_submit, worker = engine.worker.submit, engine.worker

    def submit(plan):
        pending = real_submit(plan)
        events.append(("dispatched", plan.step_id, time.perf_counter()))
        real_result = pending.result

        def result():
            events.append(("read", plan.step_id, time.perf_counter()))
            out = real_result()
            events.append(("tokens", plan.step_id, time.perf_counter()))
            return out

        pending.result = result
        return pending

    monkeypatch.setattr(worker, "submit", submit)
    for _ in range(3):  # warm the slowed body's compile
        engine.step()
    events.clear()
    for _ in range(4):
        engine.step()
    at = {(kind, step): t for kind, step, t in events}
    order = [e[:2] for e in events]
    checked = 0
    for (kind, step), t in at.items():
        if kind != "tokens" or ("dispatched", step + 1) not in at:
            continue
        assert order.index(("dispatched", step + 1)) < order.index(("read", step))
        # Step N + 1 was dispatched while step N was still on the device.
        assert at[("dispatched", step + 1)] < t - delay / 2
        checked += 1
    assert checked >= 3
    engine.shutdown()


def test_upload_is_o_of_r_independent_of_context_and_max_num_seqs(tiny, monkeypatch):
    sizes, transfers = {}, _Transfers(monkeypatch)
    for max_num_seqs, max_model_len, rows in [(8, 64, 1), (8, 256, 1), (16, 256, 1),
                                               (8, 64, 8), (16, 256, 8)]:
        engine = _engine(tiny, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                         request_buckets=(1, 8, max_num_seqs) if max_num_seqs > 8 else (1, 8),
                         token_buckets=(1, 8, 64), precompile=False)
        _start(engine, rows, prompt_len=40 if max_model_len > 64 else 5)
        transfers.upload_bytes.clear()
        engine.step()
        sizes[(max_num_seqs, max_model_len, rows)] = list(transfers.upload_bytes)
        engine.shutdown()
    print("steady decode upload bytes (M, L, R) ->", sizes)
    assert sizes[(8, 64, 1)] == sizes[(8, 256, 1)] == sizes[(16, 256, 1)]
    assert sizes[(8, 64, 8)] == sizes[(16, 256, 8)]
    one, eight = sizes[(8, 64, 1)][0], sizes[(8, 64, 8)][0]
    assert one < eight <= 8 * one


def test_appended_blocks_past_the_buffer_resync_the_rows(tiny):
    """A step whose appended blocks overflow its buffer writes the rows' tables whole."""
    engine = _engine(tiny, precompile=False)
    worker = engine.worker

    i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
    prompt = i32(np.arange(1, 30))
    layout = worker.layouts[8]
    blocks = i32(np.arange(1, 2 + layout.num_appends + 8))  # far more than the buffer holds
    plan = StepPlan(step_id=100, freed_rows=i32([]), new_rows=(NewRow(
        row=7, token_ids=prompt, num_prompt_tokens=29, sampling_params=SamplingParams(),
        seed=None, block_ids=blocks[:1]),), append_rows=i32([7] * (len(blocks) - 1)),
        append_block_ids=blocks[1:], rows=i32([7]), num_computed=i32([0]),
        num_tokens=i32([4]), sample=np.array([False]), num_tokens_bucket=8, num_reqs_bucket=0)
    worker.execute(plan)
    table = np.asarray(worker.device_rows.block_table)[7]
    np.testing.assert_array_equal(table[:len(blocks)], blocks)
    assert worker.rows.num_blocks[7] == len(blocks)
    engine.shutdown()
