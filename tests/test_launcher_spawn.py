"""The launcher starts its processes safely from a process busy with gRPC.

grpcio >= 1.80 runs its fork handlers in a child that Python forks (rather
than vforks), and the child's restarted poller thread can abort on the epoll
descriptor that ``close_fds`` closed: the child dies with SIGABRT before exec
(an api process was lost that way in CI). ``spawn_child`` starts children
without a ``preexec_fn``, so Python vforks; each child asks to die with the
launcher itself (``die_with_launcher``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from jaxserve.launcher import spawn_child

SPAWNS = 300  # with a preexec_fn, about 2 % of children died here (6 of 300)


def test_children_survive_spawning_under_live_grpc_traffic():
    server = grpc.server(futures.ThreadPoolExecutor(4))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    stop = threading.Event()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)

        def traffic() -> None:
            while not stop.is_set():
                stub.Check(health_pb2.HealthCheckRequest())

        threads = [threading.Thread(target=traffic, daemon=True) for _ in range(4)]
        for thread in threads:
            thread.start()
        try:
            codes = [spawn_child(["true"], dict(os.environ), process_group=0).wait(timeout=30)
                     for _ in range(SPAWNS)]
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=10)
    server.stop(None)
    assert codes == [0] * SPAWNS


def test_a_child_reads_and_removes_its_parent_pid():
    """The child gets the launcher's pid and removes it, so its own children do not inherit it."""
    code = ("import os; from jaxserve.procutil import PARENT_PID_ENV, die_with_launcher\n"
            "pid = os.environ[PARENT_PID_ENV]; die_with_launcher()\n"
            "print(pid, PARENT_PID_ENV in os.environ)")
    proc = spawn_child([sys.executable, "-c", code], {**os.environ, "PYTHONPATH": os.getcwd()},
                       process_group=0, stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert out.split() == [str(os.getpid()), "False"]
