"""The engine process never imports jax (docs/architecture.md: process boundaries)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

_CODE = """
import sys
import jaxserve.engine, jaxserve.step_plan, jaxserve.outputs
from jaxserve.engine import block_manager, config, core, messages, plan_builder, request, scheduler
from tests.engine.fake_worker import FakeWorker
from jaxserve.engine import EngineConfig, EngineCore, EngineCoreRequest, SchedulerConfig, CacheConfig
from jaxserve.sampling_params import SamplingParams
engine = EngineCore(EngineConfig(max_model_len=64, scheduler=SchedulerConfig(max_num_seqs=2),
                                 cache=CacheConfig(block_size=4, num_kv_blocks=40)), FakeWorker())
engine.add_request(EngineCoreRequest("a", [1, 2, 3], SamplingParams(max_tokens=3)))
while engine.has_unfinished_requests():
    engine.step()
bad = sorted(m for m in sys.modules if m == "jax" or m.startswith(("jax.", "jaxlib", "flax")))
assert not bad, bad
"""


def test_engine_runs_without_importing_jax():
    repo = pathlib.Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", _CODE], check=True, timeout=120, cwd=repo)
