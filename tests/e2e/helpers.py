"""Helpers for the end-to-end tests: the real worker, engine and api processes on loopback.

``serve(demo_model_dir, engine_flags, ...)`` starts ``jaxserve.launcher.Launcher``
(the code ``jaxserve serve`` runs) on free loopback ports and waits until the
api reports SERVING. Each test module starts its server once (a
module-scoped fixture): start-up loads the model and the step executables
(from the persistent compilation cache the test session shares,
tests/conftest.py), which costs tens of seconds on this CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import time
from collections.abc import Iterator

import grpc

from jaxserve.client import AsyncClient, Client, JaxServeError
from jaxserve.launcher import Launcher, ServeOptions
from jaxserve.procutil import free_port

READY_TIMEOUT_S = 900.0  # a cold compilation cache compiles every step executable
# Small engine limits for modules that need few sequences at once.
SMALL_ENGINE = ("--max-num-seqs", "4", "--max-num-batched-tokens", "64")
# Short prompts of different lengths for tests that compare servers' tokens.
PROMPTS = ["The history of the printing press", "def add(a, b):", "Once upon a time",
           "The three primary colors are", "In 1969, astronauts", "A recipe for pancakes:",
           "Photosynthesis is the process", "Water boils at"]
# The demo command's limits (``jaxserve demo``): modules using them share its executables.
DEMO_ENGINE = ("--max-num-seqs", "1", "--max-num-batched-tokens", "64", "--token-buckets", "1,64")


@contextlib.contextmanager
def serve(model_dir: pathlib.Path, engine_flags: tuple[str, ...] = SMALL_ENGINE, *,
          max_waiting_requests: int = 256, metrics_port: int = 0,
          **options: object) -> Iterator[Launcher]:
    """A running server (``launcher.address``), shut down on exit.

    ``options``: further ``ServeOptions`` fields (``http_port``, ``api_key``, ...).
    """
    launcher = Launcher(ServeOptions(
        model=str(model_dir), port=free_port(), metrics_port=metrics_port,
        max_waiting_requests=max_waiting_requests, engine_flags=engine_flags,
        log_level=os.environ.get("JAXSERVE_TEST_SERVER_LOG_LEVEL", "WARNING"),
        **{"shutdown_grace": 5.0, **options}))
    try:
        launcher.start()
        launcher.wait_ready(READY_TIMEOUT_S)
        yield launcher
    finally:
        launcher.shutdown()


def wait_all_blocks_free(client: Client, timeout: float = 30.0) -> tuple[int, int]:
    """Polls GetModelInfo until every KV block is free; returns (free, total) at the end.

    The engine answers between steps and the api gives it 10 s: on a loaded 2-core
    machine a step of many demo-model rows has taken longer, so UNAVAILABLE ("the
    engine did not answer") is polled again until ``timeout`` has passed.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            info = client.model_info()
        except JaxServeError as err:
            if err.code != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            continue
        if info.num_kv_blocks_free == info.num_kv_blocks_total or time.monotonic() > deadline:
            return info.num_kv_blocks_free, info.num_kv_blocks_total
        time.sleep(0.1)


def child_pids(pid: int) -> list[int]:
    """The direct children of ``pid`` (Linux /proc); a thread may end while it is read."""
    out = []
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread exited between the listing and the read
    return out


def process_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout: float = 20.0) -> list[int]:
    """Waits until none of ``pids`` is alive; returns those still alive at the timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if process_alive(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return [p for p in pids if process_alive(p)]


def generate_concurrently(address: str, prompts: list[str], **params) -> list:
    """Every prompt at once through the async client; the ``GenerateResult``s in order."""
    async def generate_all():
        async with AsyncClient(address, timeout=300) as aclient:
            return await asyncio.gather(*(aclient.generate(p, **params) for p in prompts))

    return asyncio.run(generate_all())
