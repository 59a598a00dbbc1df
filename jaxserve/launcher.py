"""Starts and supervises jaxserve's processes: api, and engine + worker per replica (jax-free).

    with Launcher(ServeOptions(port=50051)) as server:   # start() ... shutdown()
        server.wait_ready()
        server.wait()                                     # until a signal or a child exits

Process tree (each a ``python -m`` child of the launcher, on loopback ports
the launcher picks, logging to the launcher's stderr):

    launcher ── worker  python -m jaxserve.worker.server --address 127.0.0.1:0
             ├─ api     python -m jaxserve.api.server --engine-address 127.0.0.1:E --port P
             └─ engine  python -m jaxserve.engine.service --address 127.0.0.1:E \
                            --worker-address 127.0.0.1:W

With ``data_parallel_size`` D > 1 there are D independent engine + worker
pairs (data-parallel replicas), named ``engine-0``, ``worker-0``, ...,
``engine-<D-1>``, ``worker-<D-1>`` (plain ``engine`` and ``worker`` when D is
1), and the api gets one ``--engine-address`` per replica, replica 0 first;
it routes each request to one of them (``jaxserve.api.engine_group``) and
reports SERVING once every replica is ready.

With ``num_worker_hosts`` H > 1 each replica's worker is H local worker
processes joined as one multi-host worker (``--num-hosts H --host-rank h
--coordinator-address 127.0.0.1:<free port>``), named ``worker-h0`` ..
(``worker-<r>-h<h>`` with replicas); the engine gets one ``--worker-address``
and ``--worker-pid`` per rank, rank 0 first (``jaxserve.engine.worker_group``).
This is multi-host on one machine, for tests and development; on real hosts
the workers are started by hand (docs/scale_out.md, "Multi-host").

The worker binds a free port and announces it on stdout; the engine gets
that address and its process id. The engine's port is picked by the
launcher (``free_port``). The engine supervises its worker: when it dies or
hangs, the engine starts a replacement as its own child (in the same process
group), so the launcher does not stop on a worker's exit, only on the api's
or an engine's (``jaxserve.engine.service``).

No orphans: the children share one new process group (so a terminal's Ctrl-C
reaches only the launcher, which then stops them in order), and each asks the
kernel for SIGTERM when the launcher dies (``PR_SET_PDEATHSIG``), even by
SIGKILL. ``shutdown`` sends SIGTERM to api, engine, worker in that order,
waits for each, and SIGKILLs whatever is left of the group (the engines of all
replicas together, then their workers).

The model is resolved first (the demo model is built on first use), so the
children get a local directory. JAX's persistent compilation cache defaults
to ``$JAXSERVE_CACHE/jax_cache`` so that a restart loads the worker's
executables instead of compiling them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

from jaxserve.procutil import (DEVICE_ENV_VARS, MEM_FRACTION_ENV, PARENT_PID_ENV,
                               SHUTDOWN_GRACE_ENV, WORKER_ENV, free_port, quiet_library_notices)

logger = logging.getLogger(__name__)

_STOP_TIMEOUT_S = 15.0  # per process, before SIGKILL
_ANNOUNCE_TIMEOUT_S = 300.0  # the worker imports jax and the model code before it listens
READY_LINE = "jaxserve-api: serving"  # the api process prints it on stdout once SERVING
API_KEY_ENV = "JAXSERVE_API_KEY"  # the API key reaches the api process here (argv is public)


class ServerExited(RuntimeError):
    """A server process exited on its own (start-up failure or crash)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ServeOptions:
    """What ``jaxserve serve`` takes (see ``jaxserve.commands.serve``).

    ``engine_flags`` are passed to the engine process verbatim
    (``--max-num-seqs 16 ...``, see ``jaxserve.engine.service``).
    """

    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 0
    http_port: int = 0  # the OpenAI-compatible HTTP API (0 = off)
    served_model_name: str | None = None  # the model's name in both APIs (default: its folder's)
    api_key: str | None = None  # required by both APIs (passed to the api process's environment)
    ssl_certfile: str | None = None  # TLS for both APIs (with ssl_keyfile)
    ssl_keyfile: str | None = None
    # tool_choice "auto": the --tool-call-parser of --enable-auto-tool-choice (None = refused)
    tool_call_parser: str | None = None
    max_waiting_requests: int = 256
    shutdown_grace: float = 30.0  # seconds running requests get to finish at shutdown
    engine_flags: tuple[str, ...] = ()
    log_level: str = "INFO"
    in_process_worker: bool = False  # run the model inside the engine process (development)
    generation_config: str = "auto"  # default sampling: auto / vllm / a directory (api process)
    data_parallel_size: int = 1  # engine + worker replicas behind the one api process
    num_worker_hosts: int = 1  # worker processes per replica, joined as one multi-host worker

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.num_worker_hosts < 1:
            raise ValueError(f"num_worker_hosts must be >= 1, got {self.num_worker_hosts}")
        if self.num_worker_hosts > 1 and self.in_process_worker:
            raise ValueError("num_worker_hosts > 1 needs worker processes, not in_process_worker")


def _flag_value(engine_flags: tuple[str, ...], names: tuple[str, ...]) -> str | None:
    """The value of the first of ``names`` among the engine flags (``--x v`` or ``--x=v``)."""
    for i, flag in enumerate(engine_flags):
        if flag in names and i + 1 < len(engine_flags):
            return engine_flags[i + 1]
        name, _, value = flag.partition("=")
        if value and name in names:
            return value
    return None


def _tensor_parallel_size(engine_flags: tuple[str, ...]) -> int:
    """The ``--tensor-parallel-size`` / ``-tp`` among the engine flags (1 when absent)."""
    value = _flag_value(engine_flags, ("--tensor-parallel-size", "-tp"))
    return 1 if value is None else int(value)


def _memory_utilization(engine_flags: tuple[str, ...]) -> float:
    """The ``--gpu-memory-utilization`` among the engine flags (the engine's default if absent)."""
    from jaxserve.engine.config import CacheConfig

    value = _flag_value(engine_flags, ("--gpu-memory-utilization",))
    return CacheConfig().memory_utilization if value is None else float(value)


def device_env(env: dict[str, str], process: int, devices_per_process: int) -> dict[str, str]:
    """``env`` with the GPUs of this host's ``process``-th worker process (0, 1, ...).

    Process p gets CUDA devices ``p·k .. (p + 1)·k − 1`` (k =
    ``devices_per_process``) — of those ``CUDA_VISIBLE_DEVICES`` already lists,
    when it is set — so data-parallel replicas (and local multi-host ranks)
    never share a GPU. On a host without GPUs the variable is ignored.
    """
    visible = env.get("CUDA_VISIBLE_DEVICES")
    ids = ([v for v in visible.split(",") if v.strip()] if visible
           else [str(i) for i in range((process + 1) * devices_per_process)])
    mine = ids[process * devices_per_process:(process + 1) * devices_per_process]
    return {**env, "CUDA_VISIBLE_DEVICES": ",".join(mine)}


def worker_env(env: dict[str, str], process: int, devices_per_process: int,
               memory_utilization: float) -> dict[str, str]:
    """The environment of this host's ``process``-th worker process: its GPUs, its memory.

    ``device_env``'s ``CUDA_VISIBLE_DEVICES`` (exactly its tensor-parallel
    devices, never every GPU of the machine) and ``XLA_PYTHON_CLIENT_MEM_FRACTION``
    = ``memory_utilization`` (unless already set), so JAX's pool is the share of
    each GPU's total memory vLLM's ``--gpu-memory-utilization`` means, not JAX's
    default 75 % (the KV cache is sized inside it: ``jaxserve.worker.kv_sizing``).
    """
    out = device_env(env, process, devices_per_process)
    out.setdefault(MEM_FRACTION_ENV, f"{memory_utilization:g}")
    return out


def host_only_env(env: dict[str, str], worker: dict[str, str]) -> dict[str, str]:
    """The environment of a process that never touches a GPU (api; engine with a worker process).

    No GPU is visible (``CUDA_VISIBLE_DEVICES=""``), JAX would run on the CPU
    and would not preallocate, so nothing it imports can take device memory.
    ``worker``'s device variables travel in ``WORKER_ENV`` (JSON; null = unset):
    the engine starts a replacement worker with them (``jaxserve.procutil.restore_worker_env``).
    """
    saved = {k: worker.get(k) for k in DEVICE_ENV_VARS}
    return {**env, "CUDA_VISIBLE_DEVICES": "", "JAX_PLATFORMS": "cpu",
            "XLA_PYTHON_CLIENT_PREALLOCATE": "false", WORKER_ENV: json.dumps(saved)}


def _env() -> dict[str, str]:
    from jaxserve.demo_model import cache_root

    quiet_library_notices()
    env = dict(os.environ)
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(cache_root() / "jax_cache"))
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    env.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    return env


class Launcher:
    """The three server processes. See the module docstring.

    Attributes:
      address: ``host:port`` clients connect to (the api process).
      processes: name -> ``Popen``, in start order (``replica_name`` names a
        replica's engine and worker).
      engine_addresses: each replica's engine ``host:port``, replica 0 first.
      worker_addresses: each replica's first worker ``host:port`` (empty with
        ``in_process_worker``).
    """

    def __init__(self, options: ServeOptions) -> None:
        self.options = options
        self.address = f"{_connect_host(options.host)}:{options.port}"
        self.processes: dict[str, subprocess.Popen] = {}
        self.engine_addresses: list[str] = []
        self.worker_addresses: list[str] = []
        self._engine_of: dict[str, str] = {}  # worker process name -> its engine's
        self._pgid: int | None = None
        self._api_ready = threading.Event()

    def __enter__(self) -> "Launcher":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---------------------------------------------------------------- start
    def start(self) -> None:
        """Resolves the model and starts the processes (returns at once; see ``wait_ready``).

        Raises:
          FileNotFoundError / DemoModelError: the model cannot be found or built,
            or lacks its weights or tokenizer files (``jaxserve.model_files``).
          ValueError: its generation config holds a value ``SamplingParams``
            rejects (``jaxserve.generation_config``).
        """
        from jaxserve.demo_model import resolve_model_path
        from jaxserve.generation_config import load_sampling_defaults
        from jaxserve.model_files import check_model_files

        opts = self.options
        model = str(resolve_model_path(opts.model))
        check_model_files(model)  # one line now, not a traceback in a child process later
        load_sampling_defaults(model, opts.generation_config)
        env = _env()
        # The engine and worker outlive a group-wide SIGTERM for the api's drain.
        env[SHUTDOWN_GRACE_ENV] = str(opts.shutdown_grace + _STOP_TIMEOUT_S)
        size, hosts = opts.data_parallel_size, opts.num_worker_hosts
        ports = _distinct_free_ports(size * (2 if hosts > 1 else 1))
        # Each worker process gets exactly its GPUs and its share of their memory; the api
        # and an engine with a worker process see no GPU (they never import jax).
        per_process = max(1, _tensor_parallel_size(opts.engine_flags) // hosts)
        utilization = _memory_utilization(opts.engine_flags)
        worker_envs = [[worker_env(env, r * hosts + h, per_process, utilization)
                        for h in range(hosts)] for r in range(size)]
        workers = []  # [replica][host rank]
        if not opts.in_process_worker:  # all replicas (and hosts) load and compile at once
            for r in range(size):
                group = [] if hosts == 1 else ["--num-hosts", str(hosts), "--coordinator-address",
                                               f"127.0.0.1:{ports[size + r]}"]
                self._engine_of.update({self.worker_name(r, h): self.replica_name("engine", r)
                                        for h in range(hosts)})
                workers.append([self._spawn(self.worker_name(r, h), [
                    sys.executable, "-m", "jaxserve.worker.server", "--address", "127.0.0.1:0",
                    "--exit-with-parent", "--log-level", opts.log_level, *group,
                    *(["--host-rank", str(h)] if group else [])],
                    worker_envs[r][h], stdout=subprocess.PIPE) for h in range(hosts)])
        self.engine_addresses = [f"127.0.0.1:{port}" for port in ports[:size]]
        api_cmd = [sys.executable, "-m", "jaxserve.api.server"]
        for engine_address in self.engine_addresses:
            api_cmd += ["--engine-address", engine_address]
        api_cmd += ["--model", model, "--host", opts.host, "--port", str(opts.port),
                    "--metrics-port", str(opts.metrics_port),
                    "--max-waiting-requests", str(opts.max_waiting_requests),
                    "--shutdown-grace", str(opts.shutdown_grace),
                    "--generation-config", opts.generation_config, "--log-level", opts.log_level]
        if opts.http_port:
            api_cmd += ["--http-port", str(opts.http_port)]
        if opts.served_model_name or opts.model is None:
            api_cmd += ["--served-model-name", opts.served_model_name or "SmolLM2-135M-Instruct"]
        if opts.ssl_certfile:
            api_cmd += ["--ssl-certfile", opts.ssl_certfile, "--ssl-keyfile", opts.ssl_keyfile]
        if opts.tool_call_parser:
            api_cmd += ["--enable-auto-tool-choice", "--tool-call-parser", opts.tool_call_parser]
        api_env = host_only_env(env, {})
        if opts.api_key:
            api_env[API_KEY_ENV] = opts.api_key
        # the api loads its tokenizer while the worker starts
        api = self._spawn("api", api_cmd, api_env, stdout=subprocess.PIPE)
        threading.Thread(target=_watch_ready, args=(api.stdout, self._api_ready),
                         daemon=True).start()
        for r, engine_address in enumerate(self.engine_addresses):
            engine_cmd = [sys.executable, "-m", "jaxserve.engine.service", "--address",
                          engine_address, "--model", model, "--log-level", opts.log_level,
                          *opts.engine_flags]
            if not workers:
                engine_cmd.append("--in-process-worker")
            else:
                for rank, proc in enumerate(workers[r]):
                    address = _read_announcement(proc)
                    if rank == 0:
                        self.worker_addresses.append(address)
                    engine_cmd += ["--worker-address", address, "--worker-pid", str(proc.pid)]
            # An in-process worker runs in the engine; else the engine sees no GPU and keeps
            # the worker's device variables for a replacement worker it starts.
            engine_env = (worker_envs[r][0] if not workers
                          else host_only_env(env, worker_envs[r][0]))
            self._spawn(self.replica_name("engine", r), engine_cmd, engine_env)

    def replica_name(self, kind: str, replica: int) -> str:
        """The ``processes`` key of replica ``replica``'s ``kind`` ("engine" or "worker")."""
        return kind if self.options.data_parallel_size == 1 else f"{kind}-{replica}"

    def worker_name(self, replica: int, host: int) -> str:
        """The ``processes`` key of host rank ``host`` of replica ``replica``'s worker."""
        name = self.replica_name("worker", replica)
        return name if self.options.num_worker_hosts == 1 else f"{name}-h{host}"

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str],
               stdout: int | None = None) -> subprocess.Popen:
        logger.info("starting %s: %s", name, " ".join(cmd[1:]))
        proc = spawn_child(cmd, env, process_group=0 if self._pgid is None else self._pgid,
                           stdout=stdout)
        if self._pgid is None:
            self._pgid = proc.pid
        self.processes[name] = proc
        return proc

    # -------------------------------------------------------------- running
    def exited(self) -> list[tuple[str, int]]:
        """(name, exit code) of every process that has exited."""
        return [(name, p.returncode) for name, p in self.processes.items()
                if p.poll() is not None]

    def wait_ready(self, timeout: float | None = None, poll_s: float = 0.25,
                   stop_event: threading.Event | None = None) -> float:
        """Blocks until the api reports SERVING; returns the seconds waited.

        The api process announces it on its stdout (``READY_LINE``), the
        moment its health service turns SERVING; this works the same with TLS
        and an API key on the public ports.

        Raises:
          ServerExited: a process exited first.
          TimeoutError: not ready within ``timeout`` seconds.
          InterruptedError: ``stop_event`` was set first.
        """
        start = time.monotonic()
        while not self._api_ready.wait(poll_s):
            if self.exited():
                raise ServerExited(f"server process exited during start-up: {self.exited()}")
            if timeout is not None and time.monotonic() - start > timeout:
                raise TimeoutError(f"the server was not ready within {timeout} s")
            if stop_event is not None and stop_event.is_set():
                raise InterruptedError("stopped while starting")
        return time.monotonic() - start

    def wait(self, stop_event: threading.Event | None = None, poll_s: float = 0.5) -> int:
        """Blocks until ``stop_event`` is set (0) or the api or an engine exits (1, logged).

        A worker's exit is its engine's to handle (it starts a new worker,
        or exits itself when no restart is left).
        """
        while True:
            gone = [(name, code) for name, code in self.exited()
                    if _kind(name) != "worker"]
            if gone:
                logger.error("server process exited: %s; stopping the others", gone)
                return 1
            if stop_event is not None and stop_event.wait(poll_s):
                return 0
            if stop_event is None:
                time.sleep(poll_s)

    # ------------------------------------------------------------- shutdown
    def shutdown(self, abort: threading.Event | None = None) -> None:
        """Stops the api, the engines, the workers in that order (SIGTERM, then SIGKILL
        after a timeout); the replicas' engines (then workers) stop together.

        The api first drains: running requests get up to ``shutdown_grace``
        seconds to finish. Setting ``abort`` meanwhile (a second Ctrl-C) sends
        the api SIGINT, which ends them at once (a repeated SIGTERM would not).
        """
        for kind in ("api", "engine", "worker"):
            procs = [(name, proc) for name, proc in self.processes.items()
                     if _kind(name) == kind and proc.poll() is None]
            if kind == "worker":  # a failed engine sends its workers no Shutdown: no wait
                orphans = [(name, proc) for name, proc in procs if self._engine_failed(name)]
                for _, proc in orphans:
                    proc.kill()
                    proc.wait()
                procs = [item for item in procs if item not in orphans]
            for _, proc in procs:
                proc.send_signal(signal.SIGTERM)
            limit = _STOP_TIMEOUT_S + (self.options.shutdown_grace if kind == "api" else 0.0)
            deadline = time.monotonic() + limit
            for name, proc in procs:
                forwarded = False
                while proc.poll() is None and time.monotonic() < deadline:
                    if abort is not None and abort.is_set() and not forwarded:
                        proc.send_signal(signal.SIGINT)
                        forwarded = True
                    try:
                        proc.wait(0.2)
                    except subprocess.TimeoutExpired:
                        pass
                if proc.poll() is None:
                    logger.warning("%s did not stop within %.0f s; killing it", name, limit)
                    proc.kill()
                    proc.wait()
        if self._pgid is not None:
            try:
                os.killpg(self._pgid, signal.SIGKILL)  # anything the children left behind
            except ProcessLookupError:
                pass
        if self.processes:
            logger.info("server stopped")


    def _engine_failed(self, worker_name: str) -> bool:
        """Whether the engine of worker process ``worker_name`` exited with an error."""
        engine = self.processes.get(self._engine_of.get(worker_name, ""))
        return engine is not None and engine.returncode not in (None, 0)


def _kind(name: str) -> str:
    """"api", "engine" or "worker" for a ``processes`` key ("engine-1" -> "engine")."""
    return name.split("-", 1)[0]


def _distinct_free_ports(count: int) -> list[int]:
    """``count`` different free loopback ports (``free_port`` may repeat one it released)."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def spawn_child(cmd: list[str], env: dict[str, str], *, process_group: int,
                stdout: int | None = None) -> subprocess.Popen:
    """Starts one of the launcher's processes: stdin closed, in ``process_group`` (0: a new one).

    The child learns this process's id from ``$JAXSERVE_PARENT_PID`` and asks
    to die with it (``procutil.die_with_launcher``). No ``preexec_fn``: with
    one, Python forks instead of vforking, and a process holding gRPC channels
    (a test, an application embedding the launcher) then sometimes loses the
    child to SIGABRT before exec (see ``die_with_launcher``).
    ``stdout=subprocess.PIPE`` gives a text pipe.
    """
    return subprocess.Popen(cmd, env={**env, PARENT_PID_ENV: str(os.getpid())},
                            stdin=subprocess.DEVNULL, stdout=stdout, text=stdout is not None,
                            process_group=process_group)


def _read_announcement(proc: subprocess.Popen, timeout: float = _ANNOUNCE_TIMEOUT_S) -> str:
    """The address the worker process announces on stdout (``LISTENING_PREFIX host:port``).

    The rest of its stdout is copied to stderr (it has no other output).

    Raises:
      ServerExited: the process exited or did not announce within ``timeout`` seconds.
    """
    from jaxserve.engine.grpc_worker import LISTENING_PREFIX

    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    line = lines[0] if lines else ""
    if not line.startswith(LISTENING_PREFIX):
        raise ServerExited(f"the worker process did not start (exit status {proc.poll()}, "
                           f"stdout {line!r})")
    threading.Thread(target=_copy_to_stderr, args=(proc.stdout,), daemon=True).start()
    return line.split()[1]


def _watch_ready(stream, ready: threading.Event) -> None:
    """Sets ``ready`` when the api process prints ``READY_LINE``; copies the rest to stderr."""
    for line in stream:
        if line.strip() == READY_LINE:
            ready.set()
        else:
            sys.stderr.write(line)


def _copy_to_stderr(stream) -> None:
    for line in stream:
        sys.stderr.write(line)


def _connect_host(host: str) -> str:
    """Where a local client connects for a server listening on ``host``."""
    if host in ("0.0.0.0", "", "::", "[::]"):
        return "127.0.0.1"
    return host
