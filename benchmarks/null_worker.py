"""A worker with no model: it answers every step plan at once (jax-free).

``NullWorker`` implements the worker interface (``jaxserve.step_plan.Worker``
plus ``submit`` and ``status``) without a device: ``initialize`` reports the
geometry it is asked for, and each plan returns one token per sampling row
immediately. Served by the real worker server (``jaxserve.worker.server.serve``
with ``make_worker=NullWorker``) it speaks the real worker gRPC protocol, so a
benchmark driving it measures the engine, the plan codec and the gRPC hop
alone — the host's share of a step::

    python -m benchmarks.null_worker --address 127.0.0.1:0 [--exit-with-parent]

prints ``JAXSERVE_WORKER_LISTENING <host>:<port>`` like the real worker
process (``jaxserve.engine.grpc_worker.attach_worker_process`` reads it).
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
from collections.abc import Sequence

import numpy as np

from jaxserve.step_plan import Geometry, StepPlan, StepResult, WorkerInit, WorkerStatus

DEFAULT_NUM_KV_BLOCKS = 65_537  # when the init leaves the KV size to the worker
DEFAULT_MAX_MODEL_LEN = 8192
VOCAB_SIZE = 128_256  # Llama 3's
EOS_TOKEN_ID = 0  # never sampled: the tokens are 1 .. VOCAB_SIZE - 1


class _Done:
    """A step already finished: ``submit``'s answer (``result()`` returns at once)."""

    __slots__ = ("_result",)

    def __init__(self, result: StepResult):
        self._result = result

    def result(self, timeout: float | None = None) -> StepResult:
        return self._result


class NullWorker:
    """A worker with no model; see the module docstring.

    Tokens: step ``k``'s sampling rows all get token ``1 + k % (VOCAB_SIZE - 1)``
    (never EOS), as int32.
    """

    def __init__(self) -> None:
        self.num_steps = 0
        self._ready = False

    def initialize(self, init: WorkerInit) -> Geometry:
        self._ready = True
        return Geometry(num_kv_blocks=init.num_kv_blocks or DEFAULT_NUM_KV_BLOCKS,
                        block_size=init.block_size,
                        max_model_len=init.max_model_len or DEFAULT_MAX_MODEL_LEN,
                        vocab_size=VOCAB_SIZE, eos_token_ids=(EOS_TOKEN_ID,))

    def execute(self, plan: StepPlan) -> StepResult:
        self.num_steps += 1
        token = 1 + plan.step_id % (VOCAB_SIZE - 1)
        return StepResult(plan.step_id, np.full(plan.num_sampled, token, np.int32))

    def submit(self, plan: StepPlan) -> _Done:
        return _Done(self.execute(plan))

    def status(self) -> WorkerStatus:
        return WorkerStatus(ready=self._ready, platform="null", num_steps=self.num_steps)

    def shutdown(self) -> None:
        self._ready = False


def spawn(log_level: str = "WARNING") -> subprocess.Popen:
    """Starts ``python -m benchmarks.null_worker`` on a free port (stdout piped: the announcement).

    Hand the process to ``jaxserve.engine.grpc_worker.attach_worker_process``.
    """
    return subprocess.Popen([sys.executable, "-m", "benchmarks.null_worker", "--address",
                             "127.0.0.1:0", "--exit-with-parent", "--log-level", log_level],
                            stdout=subprocess.PIPE, text=True,
                            cwd=pathlib.Path(__file__).resolve().parents[1])


def main(argv: Sequence[str] | None = None) -> int:
    from jaxserve.procutil import setup_logging
    from jaxserve.worker.server import LISTENING_PREFIX, serve

    parser = argparse.ArgumentParser(prog="python -m benchmarks.null_worker",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--address", default="127.0.0.1:0",
                        help="HOST:PORT to serve WorkerService on (port 0: any free port)")
    parser.add_argument("--exit-with-parent", action="store_true",
                        help="exit when the parent process exits")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    setup_logging("null-worker", args.log_level)
    return serve(args.address, exit_with_parent=args.exit_with_parent, make_worker=NullWorker,
                 announce=lambda bound: print(f"{LISTENING_PREFIX} {bound}", flush=True))


if __name__ == "__main__":
    sys.exit(main())
