"""``WorkerGroup``: the ``Worker`` interface over the N processes of one multi-host worker (jax-free).

    group = WorkerGroup([GrpcWorker(a) for a in addresses])   # rank 0 first
    core = EngineCore(config, group)                           # initializes every rank
    ...
    group.shutdown()

A multi-host worker is N worker processes (``python -m jaxserve.worker.server
--num-hosts N --host-rank r``) joined into one JAX multi-controller job: each
drives its own devices, and the step executables span all of them, so every
process must run the same executables in the same order on the same inputs
(docs/scale_out.md, "Multi-host"). This class keeps that contract:

- ``initialize`` sends the same ``WorkerInit`` to every rank at once (their
  start-up runs collectives, so no rank can finish before the others have
  started) and returns rank 0's ``Geometry``, after checking every rank
  reports the same;
- ``submit`` / ``execute`` send every plan to every rank, in the caller's
  order (each rank runs plans in step-id order); the result is rank 0's, once
  every rank has answered, so an error anywhere surfaces;
- a rank that dies (``WorkerDiedError`` from its ``GrpcWorker``: its
  connection closed, keepalive or the step timeout) fails the whole group at
  once: the pending step raises ``WorkerDiedError`` naming that rank, every
  other rank is killed (where this side knows its process) or asked to shut
  down, since the survivors would wait in a collective for the dead one, and
  every later call raises the same error.

There is no partial recovery: a group is replaced as a whole or not at all
(the engine process does not restart groups: ``jaxserve.engine.service``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading

from jaxserve.engine.grpc_worker import GrpcWorker, attach_worker_process, spawn_worker_process
from jaxserve.procutil import free_port
from jaxserve.step_plan import Geometry, StepPlan, StepResult, WorkerDiedError, WorkerInit, \
    WorkerStatus

logger = logging.getLogger(__name__)


class WorkerGroup:
    """The ``jaxserve.step_plan.Worker`` interface to N worker processes, rank 0 first.

    Args:
      workers: one ``GrpcWorker`` per rank (``workers[r]`` serves host rank r).

    Raises:
      ValueError: no workers.
    """

    def __init__(self, workers: list[GrpcWorker]):
        if not workers:
            raise ValueError("a worker group needs at least one worker")
        self.workers = list(workers)
        self.address = ",".join(w.address for w in self.workers)
        self._lock = threading.Lock()
        self._dead: WorkerDiedError | None = None

    # -------------------------------------------------------------- protocol
    def initialize(self, init: WorkerInit) -> Geometry:
        """Initializes every rank at once; returns rank 0's geometry.

        Raises:
          WorkerDiedError: a rank died or never answered (the group is killed).
          ValueError / RuntimeError: a rank refused or failed (the group is
            killed: the others may wait for it in a collective), or the ranks
            report different geometries.
        """
        self._check_alive()
        pool = concurrent.futures.ThreadPoolExecutor(len(self.workers),
                                                     thread_name_prefix="worker-group-init")
        futures = [pool.submit(w.initialize, init) for w in self.workers]
        try:
            for future in concurrent.futures.as_completed(futures):
                future.result()
        except BaseException as err:
            self._fail(err if isinstance(err, WorkerDiedError) else None,
                       f"initialize failed: {err}")
            raise
        finally:
            # On failure a rank this side cannot kill may still wait in a collective
            # (until JAX's heartbeat ends it): do not wait for its call here.
            pool.shutdown(wait=False)
        geometries = [f.result() for f in futures]
        if any(g != geometries[0] for g in geometries):
            self._fail(None, "ranks report different geometries")
            raise RuntimeError(f"the worker group's ranks report different geometries: "
                               f"{geometries}")
        return geometries[0]

    def execute(self, plan: StepPlan) -> StepResult:
        """Sends one plan to every rank and waits; raises what ``submit``'s future raises."""
        return self.submit(plan).result()

    def submit(self, plan: StepPlan) -> concurrent.futures.Future:
        """Sends one plan to every rank now; the future's result is rank 0's ``StepResult``.

        Plans must be submitted in step order. The future raises
        ``WorkerDiedError`` as soon as any rank is found dead (the others are
        killed), else the first rank's ``ValueError`` / ``RuntimeError``.
        """
        self._check_alive()
        done: concurrent.futures.Future = concurrent.futures.Future()
        try:
            parts = [w.submit(plan) for w in self.workers]
        except WorkerDiedError as err:  # a rank found dead outside a step (``status``)
            self._fail(err, f"step {plan.step_id} not sent: {err}")
            raise self._dead from None
        remaining = [len(parts)]
        lock = threading.Lock()

        def finish(_: concurrent.futures.Future) -> None:
            with lock:
                if done.done():
                    return
                failed = next((p for p in parts if p.done() and p.exception() is not None), None)
                if failed is None:
                    remaining[0] -= 1
                    if remaining[0] == 0:
                        done.set_result(parts[0].result())
                    return
            err = failed.exception()
            if not isinstance(err, WorkerDiedError):
                # A rank killed mid-step first shows as the others' collective
                # error (a closed peer connection): its death is the cause.
                err = next((e for e in (w.exited() for w in self.workers) if e), err)
            died = isinstance(err, WorkerDiedError)
            self._fail(err if died else None, f"step {plan.step_id} failed: {err}")
            with lock:  # a death: the first rank found dead, not a rank killed since
                if not done.done():
                    done.set_exception(self._dead if died else err)

        for part in parts:
            part.add_done_callback(finish)
        return done

    def shutdown(self) -> None:
        """Shuts every rank down at once (they leave the JAX job together). Never raises."""
        with concurrent.futures.ThreadPoolExecutor(len(self.workers)) as pool:
            list(pool.map(lambda w: w.shutdown(), self.workers))

    def kill(self, why: str = "killed by the engine") -> None:
        """Kills every rank whose process this side knows; marks the group dead. Never raises."""
        for worker in self.workers:
            worker.kill(why)
        with self._lock:
            if self._dead is None:
                self._dead = WorkerDiedError(f"the worker group {self.address} died: {why}")

    # ---------------------------------------------------------------- extras
    def status(self, timeout: float = 10.0) -> WorkerStatus:
        """Rank 0's status, ``ready`` only when every rank is."""
        self._check_alive()
        statuses = [w.status(timeout) for w in self.workers]
        first = statuses[0]
        return WorkerStatus(ready=all(s.ready for s in statuses), platform=first.platform,
                            num_executables=first.num_executables,
                            compile_seconds=max(s.compile_seconds for s in statuses),
                            num_cache_hits=first.num_cache_hits,
                            num_recompiles=max(s.num_recompiles for s in statuses),
                            num_steps=min(s.num_steps for s in statuses))

    def start_profile(self, directory: str) -> None:
        """Starts a profiler trace on every rank's host, into ``directory`` (each host's own)."""
        for worker in self.workers:
            worker.start_profile(directory)

    def stop_profile(self) -> None:
        for worker in self.workers:
            worker.stop_profile()

    @property
    def dead(self) -> bool:
        return self._dead is not None

    # -------------------------------------------------------------- internal
    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead

    def _fail(self, err: WorkerDiedError | None, why: str) -> None:
        """Marks the group dead (with ``err``, a rank's death, when given) and stops every rank.

        Ranks this side started (or knows the process id of) are killed; the
        others are asked to shut down, in the background (a rank that waits
        for the dead one in a collective may not answer).
        """
        with self._lock:
            if self._dead is not None:
                return
            self._dead = err or WorkerDiedError(f"the worker group {self.address} failed: {why}")
        logger.error("worker group failed (%s); stopping every rank", why)
        for worker in self.workers:
            if worker.process is not None or worker.pid is not None:
                worker.kill(f"the worker group failed: {why}")
            else:
                threading.Thread(target=worker.shutdown, daemon=True,
                                 name="worker-group-shutdown").start()


def start_worker_group(num_hosts: int, *, env: dict[str, str] | None = None,
                       log_level: str = "INFO", compilation_cache_dir: str | None = None,
                       start_timeout: float = 120.0, **worker_kwargs) -> WorkerGroup:
    """Starts ``num_hosts`` worker processes on this machine as one multi-host group.

    Each is ``python -m jaxserve.worker.server --num-hosts N --host-rank r
    --coordinator-address 127.0.0.1:<free port>`` on a free loopback port, a
    child of this process (``--exit-with-parent``): multi-host on one machine,
    for tests and development. ``env`` is added to every process's environment
    (e.g. ``XLA_FLAGS=--xla_force_host_platform_device_count=2``).

    Raises:
      WorkerDiedError: a process exited or did not announce itself within
        ``start_timeout`` seconds (every process is then killed).
    """
    coordinator = f"127.0.0.1:{free_port()}"
    procs = [spawn_worker_process(
        compilation_cache_dir=compilation_cache_dir, log_level=log_level, env=env,
        extra_args=("--num-hosts", str(num_hosts), "--host-rank", str(rank),
                    "--coordinator-address", coordinator)) for rank in range(num_hosts)]
    try:
        # They join each other before they listen: all were started above.
        return WorkerGroup([attach_worker_process(p, start_timeout, **worker_kwargs)
                            for p in procs])
    except BaseException:
        for proc in procs:
            proc.kill()
            proc.wait()
        raise
