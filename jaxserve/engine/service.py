"""The engine process: ``EngineCore`` on a step-loop thread, served as ``jaxserve.EngineService``.

    python -m jaxserve.engine.service --address 127.0.0.1:50061 \\
        --worker-address 127.0.0.1:50062 --model DIR [engine flags]

A multi-host worker (docs/scale_out.md, "Multi-host") is one
``--worker-address`` per host, rank 0 first, reached through
``jaxserve.engine.worker_group.WorkerGroup``; it is never restarted: a
failed group stops the engine as a worker failure with no restart left does.

Started by ``jaxserve serve`` (``jaxserve.launcher``); the api process is its
only client (``proto/jaxserve/engine.proto`` documents the service). The
worker is the worker process, reached through
``jaxserve.engine.grpc_worker.GrpcWorker``, so this process never imports
jax. ``--in-process-worker`` runs the model in this process instead (it then
imports jax): for development and tests only.

Start-up: initialize the worker (it loads the model and compiles: the slow
part), then bind the gRPC server, so once the port answers the engine is
ready. It serves ``grpc.health.v1`` for "" and "jaxserve.EngineService":
SERVING, then NOT_SERVING once a step fails (the worker died, or a step took
longer than ``--step-timeout``); in-flight requests then fail with the error
(``EngineLoop``).

**Worker supervision.** After a failure the engine kills the old worker
process (a hung one still holds the device), starts a new one (``python -m
jaxserve.worker.server``, a child of this process that exits with it;
its executables load from the persistent compilation cache), initializes it
and serves again on a fresh ``EngineCore`` (empty scheduler, every KV block
free): health SERVING, and the api's output stream can be opened again. At
most ``--max-worker-restarts`` attempts in the process's life (each logged
and counted in ``GetStats.num_worker_restarts``); then the process exits
with status 1. ``--in-process-worker`` never restarts.

SIGINT / SIGTERM stop it: it first keeps serving until no request is left
unfinished, for at most ``procutil.shutdown_grace()`` seconds (the launcher
sets it so that the api's drain completes even when every process of the
group is signalled at once; a second signal ends the wait), then the server
refuses new calls, the loop stops and the worker is shut down.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from jaxserve.config import KV_CACHE_DTYPES, QUANTIZATION_METHODS
from jaxserve.engine.config import (AUTO_DTYPE, SERVED_DTYPES, CacheConfig, EngineConfig,
                                    SchedulerConfig, SpeculativeConfig)
from jaxserve.engine.core import EngineCore
from jaxserve.engine.grpc_worker import GrpcWorker, start_worker_process
from jaxserve.engine.loop import EngineDeadError, EngineLoop, OutputBatch
from jaxserve.engine.worker_group import WorkerGroup
from jaxserve.procutil import (StopSignal, die_with_launcher, keep_torch_out, setup_logging,
                               shutdown_grace)
from jaxserve.proto import engine_pb2 as epb
from jaxserve.proto import engine_pb2_grpc as epb_grpc
from jaxserve.proto.engine_convert import add_outputs, request_from_proto, stats_to_proto
from jaxserve.status_details import status_details

logger = logging.getLogger(__name__)

SERVICE_NAME = "jaxserve.EngineService"
# Most queued step batches merged into one stream message when the api lags.
_MAX_MERGED_BATCHES = 64


class EngineServicer(epb_grpc.EngineServiceServicer):
    """``EngineService`` over an ``EngineLoop`` (sync gRPC; handlers run on a thread pool)."""

    def __init__(self, loop: EngineLoop, info: epb.EngineInfo) -> None:
        self.loop = loop
        self.info = info

    def GetEngineInfo(self, request: epb.GetEngineInfoRequest,
                      context: grpc.ServicerContext) -> epb.EngineInfo:
        return self.info

    def AddRequest(self, request: epb.EngineRequest,
                   context: grpc.ServicerContext) -> epb.AddRequestResponse:
        try:
            self.loop.add_request(request_from_proto(request))
        except NotImplementedError as err:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, status_details(str(err)))
        except EngineDeadError as err:
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          status_details(f"the engine is not serving: {err}"))
        except ValueError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, status_details(str(err)))
        return epb.AddRequestResponse()

    def AbortRequests(self, request: epb.AbortRequestsRequest,
                      context: grpc.ServicerContext) -> epb.AbortRequestsResponse:
        targets = [(t.request_id, t.index) if t.HasField("index") else t.request_id
                   for t in request.targets]
        try:
            self.loop.abort(targets)
        except EngineDeadError:
            pass  # nothing runs any more
        return epb.AbortRequestsResponse()

    def StreamOutputs(self, request: epb.StreamOutputsRequest,
                      context: grpc.ServicerContext) -> Iterator[epb.EngineOutputBatch]:
        try:
            q = self.loop.subscribe()
        except EngineDeadError as err:
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          status_details(f"the engine is not serving: {err}"))
        context.add_callback(lambda: q.put(None))  # wakes the get below when the call ends
        logger.info("api process subscribed to outputs")
        try:
            yield epb.EngineOutputBatch()  # confirms the subscription: outputs follow
            while True:
                batches = _take_batches(q)
                if batches is None:
                    return
                message = epb.EngineOutputBatch()
                for batch in batches:
                    add_outputs(message.outputs, batch.outputs)
                    if batch.error:
                        message.error = batch.error
                        message.failed_request_ids.extend(batch.failed_request_ids)
                yield message
                if message.error:
                    return
        finally:
            self.loop.unsubscribe(q)
            logger.info("api process unsubscribed; aborting its unfinished requests")
            try:
                self.loop.abort_all()
            except EngineDeadError:
                pass

    def GetStats(self, request: epb.GetStatsRequest,
                 context: grpc.ServicerContext) -> epb.EngineStatsResponse:
        return stats_to_proto(self.loop.stats(), serving=self.loop.serving,
                              error=self.loop.error)


def _take_batches(q: "queue.SimpleQueue[OutputBatch | None]") -> list[OutputBatch] | None:
    """Blocks for one batch, then takes whatever else is queued; None when the call ended."""
    first = q.get()
    if first is None:
        return None
    batches = [first]
    while len(batches) < _MAX_MERGED_BATCHES and not batches[-1].error:
        try:
            batch = q.get_nowait()
        except queue.Empty:
            break
        if batch is None:
            q.put(None)  # end the stream after sending these
            break
        batches.append(batch)
    return batches


def engine_info(core: EngineCore) -> epb.EngineInfo:
    """The ``GetEngineInfo`` answer for a running core."""
    cfg, geo = core.config, core.geometry
    return epb.EngineInfo(
        model=cfg.model or "", dtype=cfg.dtype, num_kv_blocks=geo.num_kv_blocks,
        block_size=geo.block_size, max_model_len=geo.max_model_len, vocab_size=geo.vocab_size,
        eos_token_ids=list(geo.eos_token_ids), max_num_seqs=cfg.scheduler.max_num_seqs,
        max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
        quantization=cfg.quantization or "",
        kv_cache_dtype=cfg.cache.kv_cache_dtype)


class EngineServer:
    """An ``EngineCore`` served on ``address``: the step loop, EngineService and health.

    Args:
      core: the engine core (its worker initialized).
      address: HOST:PORT to bind.
      max_workers: gRPC handler threads.
      restart: ``restart(old_core) -> new_core`` (see ``EngineLoop``); None =
        a failure is final.
      max_restarts: restart attempts allowed.
      gave_up: an event to set when the engine failed with no restart left;
        None = a new one.

    Attributes:
      gave_up: that event.

    Raises:
      RuntimeError: ``address`` cannot be bound.
    """

    def __init__(self, core: EngineCore, address: str, max_workers: int = 16, *,
                 restart: Callable[[EngineCore], EngineCore] | None = None,
                 max_restarts: int = 0,
                 gave_up: threading.Event | None = None) -> None:
        self.address = address
        self.health = health.HealthServicer()
        self.gave_up = gave_up if gave_up is not None else threading.Event()
        self.loop = EngineLoop(core, on_failure=self._on_failure, restart=restart,
                               max_restarts=max_restarts, on_recovery=self._on_recovery,
                               on_give_up=self.gave_up.set)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers,
                                                             thread_name_prefix="engine-rpc"),
                                  options=[("grpc.so_reuseport", 0)])
        epb_grpc.add_EngineServiceServicer_to_server(
            EngineServicer(self.loop, engine_info(core)), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise RuntimeError(f"cannot bind the engine's address {address}")

    def start(self) -> None:
        """Starts the step loop and the server; health SERVING."""
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.loop.start()
        self.server.start()

    def _on_failure(self, error: str) -> None:
        logger.error("engine not serving: %s", error)
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    def _on_recovery(self) -> None:
        logger.warning("engine serving again")
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def drain(self, timeout: float, abort: threading.Event) -> None:
        """Keeps serving until no request is unfinished or no output stream is open (the api
        has gone: nobody reads what is left), ``timeout`` seconds pass, or ``abort``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not abort.is_set() and self.loop.serving:
            stats = self.loop.stats()
            if stats.num_running + stats.num_waiting == 0 or not self.loop.num_subscribers:
                return
            logger.info("engine draining: %d running, %d waiting", stats.num_running,
                        stats.num_waiting)
            abort.wait(0.5)

    def stop(self, grace: float = 1.0) -> None:
        """Refuses new calls, ends the streams, stops the loop, shuts the worker down."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace=grace).wait()
        self.loop.stop()
        self.loop.core.shutdown()


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine's flags (also taken by ``jaxserve serve``, which passes them on)."""
    parser.add_argument("--model", default=None,
                        help="Hugging Face model directory (default: the demo model)")
    parser.add_argument("--dtype", default=AUTO_DTYPE, choices=(AUTO_DTYPE, *SERVED_DTYPES),
                        help="model dtype: auto (default: float32 on a CPU, bfloat16 on a GPU), "
                             "float32 or bfloat16 (float16 is refused)")
    parser.add_argument("--max-num-seqs", type=int, default=64,
                        help="most sequences running at once (default 64)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512,
                        help="token budget of one step (default 512)")
    parser.add_argument("--token-buckets", type=bucket_ladder, default=(), metavar="T,T,...",
                        help="the T ladder: step sizes in tokens, increasing, the last one at "
                             "least --max-num-batched-tokens; every one is a compiled model body "
                             "(default: 1, 4, then powers of two up to the budget)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest sequence in tokens (default: the model's)")
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="KV blocks (default: from --kv-cache-bytes)")
    parser.add_argument("--kv-cache-bytes", type=int, default=None,
                        help="KV cache budget in bytes when --num-kv-blocks is not given "
                             "(default: the engine's)")
    parser.add_argument("--gpu-memory-utilization", type=_unit_fraction, default=0.9,
                        help="fraction of each GPU's total memory the worker may use: weights, "
                             "activations and the KV cache, which gets the rest (default 0.9, "
                             "as vLLM's; the worker's XLA_PYTHON_CLIENT_MEM_FRACTION)")
    parser.add_argument("--no-prefix-caching", "--no-enable-prefix-caching",
                        dest="no_prefix_caching", action="store_true",
                        help="turn prefix caching off")
    parser.add_argument("--enable-prefix-caching", dest="no_prefix_caching",
                        action="store_false",
                        help="prefix caching on (the default; vLLM's flag)")
    parser.add_argument("--no-chunked-prefill", action="store_true",
                        help="turn chunked prefill off")
    parser.add_argument("--seed", type=int, default=0, help="server seed for unseeded sampling")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                        help="plan step N + 1 while the worker runs step N (default on: it hides "
                             "the engine's CPU time and the gRPC hop behind the device; measured "
                             "in docs/worker.md)")
    parser.add_argument("--scan-layers", action="store_true",
                        help="run the layers with jax.lax.scan over stacked weights: compiles "
                             "~4x faster, decodes ~1.3x slower on the CPU (docs/model.md)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1,
                        help="devices the worker splits the model and KV cache over (default "
                             "1; docs/scale_out.md)")
    parser.add_argument("--load-format", choices=("auto", "safetensors", "orbax"),
                        default="auto",
                        help="safetensors = convert the Hugging Face weights; orbax = restore "
                             "the parameter checkpoint `jaxserve save-checkpoint` wrote into the "
                             "model directory; auto = the checkpoint when there is one")
    parser.add_argument("--quantization", "-q", choices=QUANTIZATION_METHODS, default=None,
                        help="quantize the weights at load time (vLLM's flag): int8 = "
                             "weight-only int8 with a float32 scale per output channel; "
                             "int4 = weight-only int4, a float32 scale per group of 32 inputs; "
                             "fp8 = e4m3 weights (a float32 scale per output channel) and "
                             "activations (a scale per token), a GPU of compute capability "
                             ">= 8.9 only (docs/model.md); default: the checkpoint's weights as "
                             "they are (a compressed-tensors fp8 checkpoint: fp8)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="the KV cache's element type (vLLM's flag): auto = the model's "
                             "dtype; fp8 / fp8_e4m3 = e4m3 with a scale per layer, 1 byte an "
                             "element, so the same memory holds 2x the tokens of a bfloat16 "
                             "cache, 4x a float32 one's (docs/kv_cache.md)")
    parser.add_argument("--speculative-config", type=speculative_config, default=None,
                        metavar="JSON",
                        help="speculative decoding (vLLM's flag), e.g. '{\"method\": \"ngram\", "
                             "\"num_speculative_tokens\": 3, \"prompt_lookup_max\": 4}': "
                             "n-gram prompt lookup proposes up to k tokens per step and the step "
                             "verifies them; or '{\"model\": DIR, \"num_speculative_tokens\": "
                             "4}': a draft model sharing the tokenizer proposes them "
                             "(docs/speculative_decoding.md); default off")
    parser.add_argument("--max-worker-restarts", type=_non_negative_int, default=3,
                        help="worker processes the engine may start to replace a dead or hung "
                             "one, in its life (default 3; 0 = a worker failure is final)")
    parser.add_argument("--step-timeout", type=_positive_float, default=300.0,
                        help="seconds one step may take in the worker before the worker is "
                             "treated as hung: killed and replaced (default 300; start-up "
                             "compilation is not a step)")


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1 (argparse reports the error and exits 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def bucket_ladder(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated positive ints ("1,64"); checked by ``SchedulerConfig``."""
    try:
        return tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated integers: {text!r}") from None


def speculative_config(text: str) -> SpeculativeConfig:
    """An argparse type: vLLM's ``--speculative-config`` JSON object."""
    try:
        value = json.loads(text)
    except ValueError as err:  # json.JSONDecodeError
        raise argparse.ArgumentTypeError(f"invalid JSON ({err}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {text!r}")
    try:
        return SpeculativeConfig.from_dict(value).with_model_checked()
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _unit_fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags of parsed ``add_engine_arguments`` values, except ``--model``."""
    flags = ["--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--block-size", str(args.block_size), "--seed", str(args.seed),
             "--gpu-memory-utilization", repr(args.gpu_memory_utilization)]
    if args.token_buckets:
        flags += ["--token-buckets", ",".join(map(str, args.token_buckets))]
    if args.kv_cache_bytes is not None:
        flags += ["--kv-cache-bytes", str(args.kv_cache_bytes)]
    if args.max_model_len is not None:
        flags += ["--max-model-len", str(args.max_model_len)]
    if args.num_kv_blocks is not None:
        flags += ["--num-kv-blocks", str(args.num_kv_blocks)]
    if args.no_prefix_caching:
        flags.append("--no-prefix-caching")
    if args.no_chunked_prefill:
        flags.append("--no-chunked-prefill")
    flags.append("--async-scheduling" if args.async_scheduling else "--no-async-scheduling")
    if args.scan_layers:
        flags.append("--scan-layers")
    flags += ["--tensor-parallel-size", str(args.tensor_parallel_size),
              "--load-format", args.load_format]
    if args.quantization is not None:
        flags += ["--quantization", args.quantization]
    if args.kv_cache_dtype != "auto":
        flags += ["--kv-cache-dtype", args.kv_cache_dtype]
    if args.speculative_config is not None:
        flags += ["--speculative-config",
                  json.dumps(dataclasses.asdict(args.speculative_config))]
    flags += ["--max-worker-restarts", str(args.max_worker_restarts),
              "--step-timeout", repr(args.step_timeout)]
    return flags


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` of parsed engine flags. Raises ValueError on bad values."""
    return EngineConfig(
        model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  enable_chunked_prefill=not args.no_chunked_prefill,
                                  token_buckets=args.token_buckets),
        cache=CacheConfig(block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                          enable_prefix_caching=not args.no_prefix_caching,
                          memory_utilization=args.gpu_memory_utilization,
                          kv_cache_dtype=args.kv_cache_dtype,
                          **({} if args.kv_cache_bytes is None
                             else {"kv_cache_bytes": args.kv_cache_bytes})),
        seed=args.seed, async_scheduling=args.async_scheduling, scan_layers=args.scan_layers,
        tensor_parallel_size=args.tensor_parallel_size, load_format=args.load_format,
        quantization=args.quantization, speculative_config=args.speculative_config)


def _make_worker(args: argparse.Namespace):
    if args.in_process_worker:
        from jaxserve.worker import InProcessWorker  # imports jax: development / tests only

        logger.warning("running the worker in the engine process (--in-process-worker)")
        return InProcessWorker()
    addresses, pids = args.worker_address, args.worker_pid or []
    workers = [GrpcWorker(address, step_timeout=args.step_timeout,
                          pid=pids[rank] if rank < len(pids) else None)
               for rank, address in enumerate(addresses)]
    return workers[0] if len(workers) == 1 else WorkerGroup(workers)


# How long a restarted worker process may take to import jax and listen (seconds).
_WORKER_START_TIMEOUT_S = 300.0


def worker_restarter(args: argparse.Namespace):
    """``restart(old_core) -> new_core`` for ``EngineLoop``: a new worker process, a new core.

    Kills the old worker (it may hang holding the device), shuts the old
    core down, starts ``python -m jaxserve.worker.server`` as a child of
    this process and initializes a new ``EngineCore`` on it.

    Raises (from ``restart``):
      WorkerDiedError: the new worker did not start or died initializing.
      RuntimeError: the new worker reports another geometry.
    """
    config = engine_config(args)

    def restart(old: EngineCore) -> EngineCore:
        if isinstance(old.worker, GrpcWorker):
            old.worker.kill("replaced by a new worker")
        old.shutdown()
        worker = start_worker_process(log_level=args.log_level,
                                      start_timeout=_WORKER_START_TIMEOUT_S,
                                      step_timeout=args.step_timeout)
        try:
            core = EngineCore(config, worker)
            if core.geometry != old.geometry:
                raise RuntimeError(f"the new worker reports {core.geometry}, "
                                   f"the old one {old.geometry}")
        except BaseException:
            worker.kill("failed to initialize")
            worker.shutdown()
            raise
        return core

    return restart


def main(argv: Sequence[str] | None = None) -> int:
    die_with_launcher()  # first: a launcher that dies from now on takes this process along
    keep_torch_out()  # before anything imports transformers
    parser = argparse.ArgumentParser(prog="python -m jaxserve.engine.service", allow_abbrev=False,
                                     description="jaxserve's engine process")
    parser.add_argument("--address", required=True, help="HOST:PORT to serve EngineService on")
    worker = parser.add_mutually_exclusive_group(required=True)
    worker.add_argument("--worker-address", action="append",
                        help="HOST:PORT of the worker process; repeated: the hosts of one "
                             "multi-host worker group, rank 0 first (docs/scale_out.md)")
    worker.add_argument("--in-process-worker", action="store_true",
                        help="run the model in this process (development and tests)")
    parser.add_argument("--worker-pid", type=int, action="append",
                        help="the worker process's id (lets the engine kill it when it hangs); "
                             "repeated: one per --worker-address, in the same order")
    parser.add_argument("--log-level", default="INFO")
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    setup_logging("engine", args.log_level)
    # Until the core is up, SIGTERM / SIGINT end the process at once (nothing to clean up).
    try:
        core = EngineCore(engine_config(args), _make_worker(args))
    except (ValueError, FileNotFoundError, NotImplementedError) as err:  # bad configuration
        logger.error("engine failed to start: %s", err)
        return 1
    except RuntimeError as err:  # the worker failed to initialize (its log has the traceback)
        logger.error("engine failed to start: %s: %s", type(err).__name__, err)
        return 1
    stop = StopSignal()
    group = not args.in_process_worker and len(args.worker_address) > 1
    if group and args.max_worker_restarts:
        logger.warning("a multi-host worker group is not restarted: its failure is final "
                       "(--max-worker-restarts %d ignored)", args.max_worker_restarts)
    restart = None if args.in_process_worker or group else worker_restarter(args)
    server = EngineServer(core, args.address, restart=restart,
                          max_restarts=args.max_worker_restarts,
                          gave_up=stop.event)  # giving up stops the process, like a signal
    server.start()
    logger.info("engine serving on %s", args.address)
    stop.wait()
    gave_up = stop.signum is None
    if not gave_up:
        server.drain(shutdown_grace(), abort=stop.again)
    logger.info("engine shutting down (%s)", "no worker restart left" if gave_up
                else f"signal {stop.signum}")
    server.stop()
    logger.info("engine stopped")
    return 1 if gave_up else 0


if __name__ == "__main__":
    sys.exit(main())
