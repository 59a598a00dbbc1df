"""``GrpcWorker``: the ``Worker`` interface over gRPC to a worker process (jax-free).

    worker = GrpcWorker("127.0.0.1:50062")     # the process: python -m jaxserve.worker.server
    core = EngineCore(config, worker)          # calls worker.initialize(...)
    ...
    worker.shutdown()                          # the worker process exits

The engine's code is the same as with ``InProcessWorker``; plans and
results cross the wire as ``proto/jaxserve/worker.proto`` messages
(``jaxserve.plan_codec``: arrays as raw little-endian bytes).

``submit(plan)`` is ``execute`` without waiting (a future): with async
scheduling the engine sends step N + 1 while step N runs, so the RPC hop
and the plan's decoding overlap the device too; the worker runs plans in
step-id order whatever order their calls arrive in.

Worker death: a killed or crashed worker closes its connection, so the call
in flight fails at once (UNAVAILABLE) and ``execute`` / ``initialize`` raise
``WorkerDiedError`` naming the address (and the process's exit status when
this object started it, ``start_worker_process``); a hung one is found by
HTTP/2 keepalive pings within ``KEEPALIVE_S`` + ``KEEPALIVE_TIMEOUT_S``, or by
``step_timeout``. After that every call raises the same error at once.
Errors the worker reports about a plan come back as ``ValueError``
(INVALID_ARGUMENT) or ``RuntimeError`` (anything else); both are fatal for
the engine too.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

import grpc

from jaxserve import plan_codec
from jaxserve.procutil import restore_worker_env
from jaxserve.proto import worker_pb2 as wpb
from jaxserve.proto import worker_pb2_grpc as wpb_grpc
from jaxserve.step_plan import (Geometry, StepPlan, StepResult, WorkerDiedError, WorkerInit,
                                WorkerStatus)

logger = logging.getLogger(__name__)

# Seconds kill() waits for a killed worker to exit: a replacement started before then
# finds the old one's GPU memory still held.
KILL_EXIT_TIMEOUT_S = 30.0
MAX_MESSAGE_BYTES = 512 << 20  # mirrors jaxserve.worker.server (which imports jax)
LISTENING_PREFIX = "JAXSERVE_WORKER_LISTENING"  # mirrors jaxserve.worker.server
KEEPALIVE_S = 10.0
KEEPALIVE_TIMEOUT_S = 10.0
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", int(KEEPALIVE_S * 1000)),
    ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 0),
]
# Status codes that mean the worker is gone rather than that it refused a call.
_DEATH_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN)


@dataclasses.dataclass(slots=True)
class WireStats:
    """Bytes and calls on the wire (serialized message sizes), for benchmarks."""

    plans: int = 0
    plan_bytes: int = 0
    result_bytes: int = 0
    last_plan_bytes: int = 0


class GrpcWorker:
    """The ``jaxserve.step_plan.Worker`` interface to a worker process.

    Args:
      address: HOST:PORT of ``python -m jaxserve.worker.server``.
      connect_timeout: seconds ``initialize`` waits for the port to answer.
      init_timeout: seconds the Initialize call may take (model load and
        compiles); None = no limit.
      step_timeout: seconds one Execute may take; None = no limit (death is
        still detected by the connection closing or keepalive).
      process: the worker's ``subprocess.Popen`` when this side started it
        (its exit status then goes into the error message).
      pid: the worker's process id when another process started it (the
        launcher); lets ``kill`` stop a hung worker.
    """

    def __init__(self, address: str, *, connect_timeout: float = 120.0,
                 init_timeout: float | None = None, step_timeout: float | None = None,
                 process: subprocess.Popen | None = None, pid: int | None = None):
        self.address = address
        self.connect_timeout = connect_timeout
        self.init_timeout = init_timeout
        self.step_timeout = step_timeout
        self.process = process
        self.pid = process.pid if process is not None else pid
        self.wire = WireStats()
        self._dead: WorkerDiedError | None = None
        self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = wpb_grpc.WorkerServiceStub(self._channel)

    # -------------------------------------------------------------- protocol
    def initialize(self, init: WorkerInit) -> Geometry:
        """Waits for the worker's port, then initializes it (model, KV cache, compiles).

        Raises:
          WorkerDiedError: the port never answered or the worker died.
          ValueError: the worker refused the configuration.
          RuntimeError: the worker failed otherwise.
        """
        self._check_alive()
        try:
            grpc.channel_ready_future(self._channel).result(timeout=self.connect_timeout)
        except grpc.FutureTimeoutError:
            raise self._died(f"no answer on {self.address} within {self.connect_timeout} s") \
                from None
        msg = self._call("initialize", self._stub.Initialize, plan_codec.init_to_proto(init),
                         self.init_timeout)
        return plan_codec.geometry_from_proto(msg)

    def execute(self, plan: StepPlan) -> StepResult:
        """Sends one plan and waits for its result.

        Raises:
          WorkerDiedError: the worker is gone (see the module docstring).
          ValueError: the worker refused the plan.
          RuntimeError: the step failed in the worker.
        """
        return self.submit(plan).result()

    def submit(self, plan: StepPlan) -> concurrent.futures.Future:
        """Sends one plan now; the future's result is its ``StepResult``.

        Plans must be submitted in step order. The future raises what
        ``execute`` raises.
        """
        self._check_alive()
        request = plan_codec.plan_to_proto(plan)
        size = request.ByteSize()
        w = self.wire
        w.plans += 1
        w.plan_bytes += size
        w.last_plan_bytes = size
        what = f"step {plan.step_id}"
        done: concurrent.futures.Future = concurrent.futures.Future()
        call = self._stub.Execute.future(request, timeout=self.step_timeout)

        def finish(call: grpc.Future) -> None:
            try:
                msg = call.result()
                w.result_bytes += msg.ByteSize()
                done.set_result(plan_codec.result_from_proto(msg))
            except grpc.RpcError as err:
                done.set_exception(self._error(what, err))
            except Exception as err:  # noqa: BLE001 - handed to the waiter
                done.set_exception(err)

        call.add_done_callback(finish)
        return done

    def shutdown(self) -> None:
        """Asks the worker process to release the device and exit; closes the channel.

        Never raises: a worker that is already gone is fine.
        """
        if self._dead is None:
            try:
                self._stub.Shutdown(wpb.ShutdownRequest(), timeout=30.0)
            except grpc.RpcError as err:
                logger.warning("worker shutdown at %s: %s", self.address, err.details())
        self._channel.close()
        if self.process is not None:
            try:
                self.process.wait(timeout=30.0)
            except subprocess.TimeoutExpired:
                logger.warning("worker process %d did not exit; killing it", self.process.pid)
                self.process.kill()
                self.process.wait()

    def kill(self, why: str = "killed by the engine", exit_timeout: float = KILL_EXIT_TIMEOUT_S
             ) -> None:
        """SIGKILLs the worker process (a hung one holds the device), waits for it, marks it dead.

        Needs ``process`` or ``pid``; without them only marks it dead. A
        ``pid`` is killed only while it still runs ``jaxserve.worker.server``
        (it may have exited and its id been reused). Returns once the process
        has exited — its GPU memory is free for a replacement — or after
        ``exit_timeout`` seconds (logged). Never raises.
        """
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            try:
                self.process.wait(exit_timeout)
            except subprocess.TimeoutExpired:
                logger.warning("worker process %d still exiting after %.0f s", self.pid,
                               exit_timeout)
        elif self.pid is not None and _runs_worker(self.pid):
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + exit_timeout
            while _runs_worker(self.pid):  # a zombie has freed its memory and has no cmdline
                if time.monotonic() > deadline:
                    logger.warning("worker process %d still exiting after %.0f s", self.pid,
                                   exit_timeout)
                    break
                time.sleep(0.05)
        if self._dead is None:
            self._died(why)

    # ---------------------------------------------------------------- extras
    def status(self, timeout: float = 10.0) -> WorkerStatus:
        """The worker's health and counters (answers while initializing too)."""
        self._check_alive()
        return plan_codec.status_from_proto(
            self._call("health", self._stub.Health, wpb.HealthRequest(), timeout))

    def start_profile(self, directory: str) -> None:
        """Starts a JAX profiler trace on the worker host, into ``directory``."""
        self._call("start_profile", self._stub.StartProfile,
                   wpb.StartProfileRequest(directory=directory), 60.0)

    def stop_profile(self) -> None:
        self._call("stop_profile", self._stub.StopProfile, wpb.StopProfileRequest(), 300.0)

    @property
    def dead(self) -> bool:
        return self._dead is not None

    def exited(self) -> WorkerDiedError | None:
        """This worker's ``WorkerDiedError`` when it is dead or its process has exited, else None.

        For a group whose other ranks fail in a collective (a closed peer
        connection) before this rank's own call reports its death.
        """
        if self._dead is None and self.process is not None and self.process.poll() is not None:
            self._died("its process exited")
        return self._dead

    # -------------------------------------------------------------- internal
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead

    def _call(self, what: str, method, request, timeout: float | None):
        try:
            return method(request, timeout=timeout)
        except grpc.RpcError as err:
            raise self._error(what, err) from None

    def _error(self, what: str, err: grpc.RpcError) -> Exception:
        """The exception for a failed call (see the module docstring)."""
        code, details = err.code(), err.details()
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return ValueError(details)
        if code in _DEATH_CODES:
            return self._died(f"{what} failed: {code.name}: {details}")
        return RuntimeError(f"worker at {self.address}: {details} ({code.name})")

    def _died(self, why: str) -> WorkerDiedError:
        exit_note = ""
        if self.process is not None:
            try:
                code = self.process.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                code = None
            if code is not None:
                exit_note = (f"; the process exited with status {code}" if code >= 0 else
                             f"; the process was killed by signal {-code}")
        self._dead = WorkerDiedError(f"the worker at {self.address} died: {why}{exit_note}")
        logger.error("%s", self._dead)
        return self._dead


def _runs_worker(pid: int) -> bool:
    """True while process ``pid`` exists and runs ``jaxserve.worker.server`` (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"jaxserve.worker.server" in f.read()
    except OSError:
        return False


def start_worker_process(address: str = "127.0.0.1:0", *, compilation_cache_dir: str | None = None,
                         log_level: str = "INFO", env: dict[str, str] | None = None,
                         start_timeout: float = 120.0, extra_args: Sequence[str] = (),
                         **worker_kwargs) -> GrpcWorker:
    """Starts ``python -m jaxserve.worker.server`` and returns a ``GrpcWorker`` for it.

    Waits until the process announces its address (``LISTENING_PREFIX``);
    the worker exits with this process (``--exit-with-parent``). stderr is
    inherited (the worker's logs); ``GrpcWorker.shutdown`` stops it.
    ``extra_args``: more worker flags (``--num-hosts`` ...).

    Raises:
      WorkerDiedError: the process exited, or did not announce itself within
        ``start_timeout`` seconds (it is then killed).
    """
    proc = spawn_worker_process(address, compilation_cache_dir=compilation_cache_dir,
                                log_level=log_level, env=env, extra_args=extra_args)
    return attach_worker_process(proc, start_timeout, **worker_kwargs)


def spawn_worker_process(address: str = "127.0.0.1:0", *, compilation_cache_dir: str | None = None,
                         log_level: str = "INFO", env: dict[str, str] | None = None,
                         extra_args: Sequence[str] = ()) -> subprocess.Popen:
    """Starts ``python -m jaxserve.worker.server`` (stdout piped, for its announcement)."""
    cmd = [sys.executable, "-m", "jaxserve.worker.server", "--address", address,
           "--exit-with-parent", "--log-level", log_level, *extra_args]
    if compilation_cache_dir:
        cmd += ["--compilation-cache-dir", compilation_cache_dir]
    # The GPUs the launcher gave the first worker (this process itself sees none).
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                            env=restore_worker_env(dict(os.environ, **(env or {}))))


def attach_worker_process(proc: subprocess.Popen, start_timeout: float = 120.0,
                          **worker_kwargs) -> GrpcWorker:
    """A ``GrpcWorker`` for a process of ``spawn_worker_process``, once it announces itself.

    Raises:
      WorkerDiedError: the process exited, or did not announce itself within
        ``start_timeout`` seconds (it is then killed).
    """
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(start_timeout)
    line = lines[0] if lines else ""
    if not line.startswith(LISTENING_PREFIX):
        proc.kill()
        status = proc.wait()
        raise WorkerDiedError(f"the worker process did not start (status {status}, "
                              f"stdout {line!r})")
    bound = line.split()[1]
    logger.info("worker process %d listening on %s", proc.pid, bound)
    threading.Thread(target=proc.stdout.read, daemon=True).start()  # drain, never block it
    return GrpcWorker(bound, process=proc, **worker_kwargs)
