"""The worker process: ``InProcessWorker`` served as ``jaxserve.worker.WorkerService``.

    python -m jaxserve.worker.server --address 127.0.0.1:50062 \\
        [--compilation-cache-dir DIR] [--exit-with-parent] [--log-level INFO] \\
        [--num-hosts N --host-rank r --coordinator-address HOST:PORT]

Multi-host (docs/scale_out.md, "Multi-host"): with ``--num-hosts`` N > 1 the
process first joins a JAX multi-controller job of N processes
(``jax.distributed.initialize``; on CPU over gloo collectives), before any
other use of JAX, so ``jax.devices()`` lists every host's devices and a
tensor-parallel mesh spans them. Every process of the group serves its own
address and must receive the same ``Initialize`` and the same plans in the
same order (``jaxserve.engine.worker_group.WorkerGroup``); each runs the same
executables, and XLA's collectives join them.

Life cycle (proto/jaxserve/worker.proto documents the service):

1. start-up: imports jax, the model code and transformers (seconds), binds
   ``--address`` (port 0 picks a free port), then prints one line on stdout,
   ``JAXSERVE_WORKER_LISTENING <host>:<port>``; from then on the port answers;
2. the engine (``jaxserve.engine.grpc_worker.GrpcWorker``) calls
   ``Initialize``: model load, KV cache, every step executable compiled or
   loaded from the persistent cache — the slow part; the standard
   ``grpc.health.v1`` service reports NOT_SERVING until it is done, then
   SERVING (service names "" and "jaxserve.worker.WorkerService");
3. one ``Execute`` per step, dispatched one at a time **in step-id order**:
   the engine may send step N + 1 while step N runs (``GrpcWorker.submit``),
   so the plan is received, decoded and dispatched to the device during
   step N (``InProcessWorker.submit``), and step N's tokens are sent back
   while step N + 1 runs; after ``Initialize`` the first plan sets the
   order, each later plan waits (up to ``STEP_ORDER_TIMEOUT_S``) for its
   predecessor's dispatch;
4. ``Shutdown`` (or SIGTERM / SIGINT) releases the device state and the
   process exits with status 0. ``--exit-with-parent`` also exits when the
   parent process goes away (no orphan worker holding the device).

The process has no other state: an engine that reconnects calls
``Initialize`` again, which replaces the previous model and cache.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from jaxserve import plan_codec
from jaxserve.procutil import (StopSignal, die_with_launcher, keep_torch_out, setup_logging,
                               shutdown_grace)
from jaxserve.proto import worker_pb2 as wpb
from jaxserve.proto import worker_pb2_grpc as wpb_grpc
from jaxserve.status_details import error_details, status_details
from jaxserve.step_plan import WorkerStatus

logger = logging.getLogger(__name__)

SERVICE_NAME = "jaxserve.worker.WorkerService"
LISTENING_PREFIX = "JAXSERVE_WORKER_LISTENING"
MAX_MESSAGE_BYTES = 512 << 20  # a plan of many long new rows can exceed gRPC's 4 MiB default
# Keepalive pings from the engine are allowed at any rate (they detect a
# hung worker); see GrpcWorker's channel options.
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),
]
STEP_ORDER_TIMEOUT_S = 120.0  # how long a plan waits for its predecessor to arrive and run
T = TypeVar("T")
# Test-only hooks, never set in production. Each fires in the first worker
# process that creates PATH (exclusively); later processes find PATH and run
# normally (a restarted worker serves).
# - JAXSERVE_TEST_HANG_ONCE=STEP:PATH: hangs forever in the Execute of step
#   id STEP, so tests can check the engine's step timeout;
# - JAXSERVE_TEST_FAIL_ONCE=WHAT:PATH: raises a RuntimeError of ~TEST_FAIL_BYTES
#   (first line "test failure in WHAT (JAXSERVE_TEST_FAIL_ONCE)") where WHAT is
#   "initialize" or "step N", so tests can check that a long error keeps its
#   cause across the process hops (``jaxserve.status_details``).
TEST_HANG_ENV = "JAXSERVE_TEST_HANG_ONCE"
TEST_FAIL_ENV = "JAXSERVE_TEST_FAIL_ONCE"
TEST_FAIL_BYTES = 50_000  # about; the text's last line is TEST_FAIL_LAST_LINE
TEST_FAIL_LAST_LINE = "the end of the test failure"
_TEST_HANG = os.environ.get(TEST_HANG_ENV, "").partition(":")
_TEST_FAIL = os.environ.get(TEST_FAIL_ENV, "").partition(":")


def _first_to_create(path: str) -> bool:
    """Whether this process created ``path`` (exclusively): a test hook fires once."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _test_hang(step_id: int) -> None:
    """The test-only hang (see ``TEST_HANG_ENV``); returns at once when it is not set."""
    step, _, path = _TEST_HANG
    if not path or step_id != int(step) or not _first_to_create(path):
        return
    logger.warning("%s is set: step %d hangs forever (test hook)", TEST_HANG_ENV, step_id)
    threading.Event().wait()


def _test_fail(what: str) -> None:
    """The test-only failure (see ``TEST_FAIL_ENV``); returns at once when it is not set.

    Raises:
      RuntimeError: of about ``TEST_FAIL_BYTES`` characters, once, in ``what``.
    """
    where, _, path = _TEST_FAIL
    if not path or what != where or not _first_to_create(path):
        return
    first = f"test failure in {what} ({TEST_FAIL_ENV})"
    lines = [first, *(f"line {i}: " + "x" * 70 for i in range(TEST_FAIL_BYTES // 80 - 1)),
             TEST_FAIL_LAST_LINE]
    raise RuntimeError("\n".join(lines))


class WorkerServicer(wpb_grpc.WorkerServiceServicer):
    """``WorkerService`` over an ``InProcessWorker``; one Initialize / Execute at a time.

    Args:
      make_worker: builds a fresh ``InProcessWorker`` for each Initialize.
      health_servicer: the grpc.health.v1 servicer to flip to SERVING.
      on_shutdown: called after a Shutdown call has released the worker.
    """

    def __init__(self, make_worker: Callable[[], object], health_servicer: health.HealthServicer,
                 on_shutdown: Callable[[], None]):
        self._make_worker = make_worker
        self._health = health_servicer
        self._on_shutdown = on_shutdown
        # Serializes Initialize / Execute / Shutdown; Execute waits on it for its turn.
        self._lock = threading.Condition()
        self._worker = None
        self._next_step = 0  # the step id that runs next

    def _set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", SERVICE_NAME):
            self._health.set(name, status)

    def _call(self, context: grpc.ServicerContext, what: str, fn: Callable[[], T]) -> T:
        """Runs ``fn``, turning its errors into gRPC statuses (see the .proto).

        The status names the error's type and first lines, at most
        ``MAX_DETAILS_BYTES`` (``jaxserve.status_details``); the log keeps
        the full traceback.

        ``fn`` must not call ``context.abort`` (it raises a plain Exception).
        """
        try:
            _test_fail(what)
            return fn()
        except ValueError as err:
            logger.warning("%s refused: %s", what, err)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, status_details(f"{what}: {err}"))
        except Exception as err:  # noqa: BLE001 - reported to the engine, which stops
            logger.exception("%s failed", what)  # the full text and traceback stay here
            context.abort(grpc.StatusCode.INTERNAL, error_details(what, err))

    def Initialize(self, request: wpb.InitializeRequest,
                   context: grpc.ServicerContext) -> wpb.Geometry:
        init = self._call(context, "initialize", lambda: plan_codec.init_from_proto(request))
        with self._lock:
            if self._worker is not None:
                logger.info("re-initializing: the previous model and KV cache are released")
                self._set_serving(False)
                self._worker.shutdown()
                self._worker = None
            worker = self._make_worker()
            geometry = self._call(context, "initialize", lambda: worker.initialize(init))
            self._worker = worker
            self._next_step = 0
            self._set_serving(True)
        return plan_codec.geometry_to_proto(geometry)

    def Execute(self, request: wpb.StepPlan, context: grpc.ServicerContext) -> wpb.StepResult:
        plan = self._call(context, f"step {request.step_id}",
                          lambda: plan_codec.plan_from_proto(request))
        _test_hang(plan.step_id)
        with self._lock:
            # A plan ahead of its turn waits; one at or behind it runs (nothing to wait for).
            if not self._lock.wait_for(lambda: plan.step_id <= self._next_step,
                                       timeout=STEP_ORDER_TIMEOUT_S):
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"step {plan.step_id} waited {STEP_ORDER_TIMEOUT_S} s for step "
                              f"{self._next_step}, which never came")
            if self._worker is None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              "the worker is not initialized (call Initialize first)")
            pending = self._call(context, f"step {plan.step_id}",
                                 lambda: self._worker.submit(plan))
            self._next_step = max(self._next_step, plan.step_id + 1)
            self._lock.notify_all()
        # Dispatched: the next plan may dispatch while this one's tokens come back.
        result = self._call(context, f"step {plan.step_id}", pending.result)
        return plan_codec.result_to_proto(result)

    def Health(self, request: wpb.HealthRequest, context: grpc.ServicerContext) -> wpb.WorkerStatus:
        worker = self._worker
        status = worker.status() if worker is not None else WorkerStatus(ready=False)
        return plan_codec.status_to_proto(status)

    def StartProfile(self, request: wpb.StartProfileRequest,
                     context: grpc.ServicerContext) -> wpb.ProfileResponse:
        worker = self._require(context)
        self._call(context, "start_profile", lambda: worker.start_profile(request.directory))
        return wpb.ProfileResponse()

    def StopProfile(self, request: wpb.StopProfileRequest,
                    context: grpc.ServicerContext) -> wpb.ProfileResponse:
        worker = self._require(context)
        self._call(context, "stop_profile", worker.stop_profile)
        return wpb.ProfileResponse()

    def _require(self, context: grpc.ServicerContext):
        if self._worker is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the worker is not initialized")
        return self._worker

    def Shutdown(self, request: wpb.ShutdownRequest,
                 context: grpc.ServicerContext) -> wpb.ShutdownResponse:
        self.release()
        self._on_shutdown()
        return wpb.ShutdownResponse()

    def release(self) -> None:
        """Releases the worker's device state (idempotent)."""
        with self._lock:
            self._set_serving(False)
            if self._worker is not None:
                self._worker.shutdown()
                self._worker = None
            self._next_step = 0
            self._lock.notify_all()


def _watch_parent(stop: threading.Event, parent: int) -> None:
    while not stop.wait(1.0):
        if os.getppid() != parent:
            logger.warning("the parent process %d is gone; the worker exits", parent)
            stop.set()


def _wait_for_stop(stop: threading.Event, signals: StopSignal | None, grace: float) -> None:
    """Until Shutdown or the parent's exit (``stop``), or ``grace`` s after a first signal
    (at once on a second): the engine it serves may still be draining."""
    signalled_at = None
    while not stop.wait(0.2):
        if signals is None or not signals.event.is_set():
            continue
        if signalled_at is None:
            signalled_at = time.monotonic()
            if grace > 0:
                logger.info("worker: signal %d; serving until Shutdown, at most %.0f s",
                            signals.signum, grace)
        if signals.again.is_set() or time.monotonic() - signalled_at >= grace:
            return


def serve(address: str, *, exit_with_parent: bool = False,
          announce: Callable[[str], None] | None = None,
          make_worker: Callable[[], object] | None = None) -> int:
    """Serves until Shutdown, SIGTERM / SIGINT (main thread only) or the parent's exit.

    After a first signal it keeps serving until Shutdown for up to
    ``procutil.shutdown_grace()`` seconds (0 unless the launcher set it).

    Args:
      address: HOST:PORT; port 0 picks a free port.
      exit_with_parent: stop when the parent process exits.
      announce: called with the bound HOST:PORT once the port answers.
      make_worker: builds the worker each Initialize serves (an object with
        ``initialize``, ``submit``, ``status`` and ``shutdown``); None =
        ``InProcessWorker``. The host-overhead benchmark serves a null worker.

    Returns:
      0 (the process exit status).

    Raises:
      RuntimeError: the address cannot be bound.
    """
    if make_worker is None:
        from jaxserve.worker.in_process import InProcessWorker  # jax, flax, the model code

        # The config reader and the supported architectures' config classes: imported
        # here, at process start, rather than inside Initialize (~1 s without torch).
        from transformers import (AutoConfig, LlamaConfig, MistralConfig,  # noqa: F401
                                  Qwen2Config, Qwen3Config)
        make_worker = InProcessWorker

    stop = threading.Event()  # Shutdown, or the parent is gone
    health_servicer = health.HealthServicer()
    servicer = WorkerServicer(make_worker, health_servicer, on_shutdown=stop.set)
    servicer._set_serving(False)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=SERVER_OPTIONS)
    wpb_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"could not bind {address}")
    bound = f"{address.rsplit(':', 1)[0]}:{port}"
    signals = StopSignal() if threading.current_thread() is threading.main_thread() else None
    if exit_with_parent:
        threading.Thread(target=_watch_parent, args=(stop, os.getppid()), daemon=True).start()
    server.start()
    logger.info("worker listening on %s (pid %d)", bound, os.getpid())
    if announce is not None:
        announce(bound)
    _wait_for_stop(stop, signals, shutdown_grace())
    logger.info("worker shutting down")
    servicer.release()
    server.stop(grace=0.5).wait()  # the Shutdown reply itself is in flight here
    return 0


def join_hosts(num_hosts: int, host_rank: int, coordinator_address: str | None) -> None:
    """Joins the multi-controller JAX job of ``num_hosts`` processes (nothing for one).

    Must run before anything else uses JAX (it fixes the backends' device
    lists). Blocks until every process has joined (at most
    ``jax.distributed.initialize``'s timeout, 300 s).

    Raises:
      ValueError: a rank outside ``[0, num_hosts)`` or no coordinator address.
    """
    if num_hosts == 1:
        return
    if not 0 <= host_rank < num_hosts:
        raise ValueError(f"--host-rank must be in [0, {num_hosts}), got {host_rank}")
    if not coordinator_address:
        raise ValueError("--num-hosts > 1 needs --coordinator-address HOST:PORT")
    import jax

    # CPU devices of different processes talk over gloo (no collectives without it).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_hosts, process_id=host_rank)
    logger.info("host %d of %d joined %s: %d devices in all, %d here", host_rank, num_hosts,
                coordinator_address, jax.device_count(), jax.local_device_count())


LEAVE_TIMEOUT_S = 10.0  # how long a multi-host worker waits for its peers at exit


def leave_hosts(timeout: float = LEAVE_TIMEOUT_S) -> None:
    """Leaves the multi-host JAX job: ``jax.distributed.shutdown``, a barrier of every process.

    With a peer gone (killed; its group failed) the barrier would wait for it
    for minutes (JAX's shutdown and heartbeat timeouts), so after ``timeout``
    seconds the process exits at once (``os._exit(0)``): the engine has
    already released it (Shutdown), and nothing is left to save.
    """
    import jax

    done = threading.Thread(target=jax.distributed.shutdown, daemon=True,
                            name="leave-hosts")
    done.start()
    done.join(timeout)
    if done.is_alive():
        logger.warning("the other hosts did not leave within %.0f s (one is gone?); exiting",
                       timeout)
        logging.shutdown()
        os._exit(0)


def main(argv: Sequence[str] | None = None) -> int:
    die_with_launcher()  # first: a launcher that dies from now on takes this process along
    keep_torch_out()  # before anything imports transformers
    parser = argparse.ArgumentParser(prog="python -m jaxserve.worker.server", allow_abbrev=False,
                                     description="jaxserve's worker (device) process")
    parser.add_argument("--address", required=True,
                        help="HOST:PORT to serve WorkerService on (port 0: any free port)")
    parser.add_argument("--compilation-cache-dir", default=None,
                        help="JAX persistent compilation cache directory (default: "
                             "$JAX_COMPILATION_CACHE_DIR, or none)")
    parser.add_argument("--exit-with-parent", action="store_true",
                        help="exit when the parent process exits")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--num-hosts", type=int, default=1,
                        help="processes (hosts) of one multi-host worker group (default 1)")
    parser.add_argument("--host-rank", type=int, default=0,
                        help="this process's rank in the group, 0 .. N-1 (rank 0 runs the "
                             "coordinator)")
    parser.add_argument("--coordinator-address", default=None,
                        help="HOST:PORT of the group's JAX coordinator, on rank 0's host; "
                             "the same for every rank")
    args = parser.parse_args(argv)
    if args.num_hosts < 1:
        parser.error(f"--num-hosts must be >= 1, got {args.num_hosts}")
    setup_logging("worker" if args.num_hosts == 1 else f"worker-{args.host_rank}",
                  args.log_level)  # as the api and engine processes
    if args.compilation_cache_dir:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = args.compilation_cache_dir
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

    def announce(bound: str) -> None:
        print(f"{LISTENING_PREFIX} {bound}", flush=True)  # CLI output: the launcher reads it

    try:
        join_hosts(args.num_hosts, args.host_rank, args.coordinator_address)
    except ValueError as err:
        parser.error(str(err))
    status = serve(args.address, exit_with_parent=args.exit_with_parent, announce=announce)
    if args.num_hosts > 1:
        leave_hosts()
    return status


if __name__ == "__main__":
    sys.exit(main())
