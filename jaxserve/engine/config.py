"""Engine configuration: scheduler, KV cache and bucket ladders (frozen, jax-free).

Values only the worker knows (the number of KV blocks when sized from a
memory budget, the model's maximum length, its EOS ids) come back from
``Worker.initialize`` as a ``Geometry``; ``EngineConfig.resolved`` returns a
new config holding them.
"""

from __future__ import annotations

import dataclasses

from jaxserve.compressed_tensors import resolve_quantization
from jaxserve.config import check_kv_cache_dtype, check_kv_cache_fits, check_quantization
from jaxserve.step_plan import Geometry, WorkerInit

# The parameter dtypes every attention backend serves: the CPU kernel (bfloat16
# widened to float32), the CPU reference and
# the Pallas GPU kernel (pallas_kernels/tuning.py takes float32 and bfloat16).
# float16 is refused at start-up rather than failing inside the kernel.
SERVED_DTYPES = ("float32", "bfloat16")
# dtype "auto" (the default, as vLLM's): the worker picks float32 on a CPU and bfloat16 on
# a GPU or TPU (jaxserve.model.loader.served_dtype).
AUTO_DTYPE = "auto"

# Bottom of the T ladder on the CPU (measured on the demo model, float32,
# docs/engine.md): with XLA's products T=2 cost as much as T=4; with the C++
# product of few rows (cpu_kernels.matmul) the model's products cost 21.0 /
# 21.2 / 22.8 ms at 1 / 2 / 4 rows, so a T=2 rung would save under 8 % of a
# two-row step for one more compiled body. The ladder goes 1, 4, 8, 16, ...
CPU_TOKEN_LADDER_BOTTOM = (1, 4)


def default_token_buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
    """T ladder: 1, 4, then powers of two up to (and always ending at) the token budget."""
    ladder = [t for t in CPU_TOKEN_LADDER_BOTTOM if t < max_num_batched_tokens]
    t = 8
    while t < max_num_batched_tokens:
        ladder.append(t)
        t *= 2
    ladder.append(max_num_batched_tokens)
    return tuple(ladder)


def default_request_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """R ladder: 1, 2, 4, ... up to (and always ending at) ``max_num_seqs``."""
    ladder, r = [], 1
    while r < max_num_seqs:
        ladder.append(r)
        r *= 2
    ladder.append(max_num_seqs)
    return tuple(ladder)


def _check_ladder(name: str, ladder: tuple[int, ...], top: int) -> None:
    if not ladder or list(ladder) != sorted(set(ladder)) or ladder[0] < 1:
        raise ValueError(f"{name} must be strictly increasing positive ints, got {ladder}")
    if ladder[-1] < top:
        raise ValueError(f"{name} must reach {top}, got {ladder}")


@dataclasses.dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Continuous-batching limits (vLLM's names).

    Attributes:
      max_num_seqs: most running sequences (worker rows).
      max_num_batched_tokens: the token budget of one step.
      enable_chunked_prefill: split long prefills over steps; when off, a
        prompt must fit the budget whole.
      token_buckets: the T ladder; () = ``default_token_buckets``.
      request_buckets: the R ladder; () = ``default_request_buckets``.

    Raises:
      ValueError: a limit < 1, or a ladder not increasing or not reaching
        its limit.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    token_buckets: tuple[int, ...] = ()
    request_buckets: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs ({self.max_num_seqs}) and max_num_batched_tokens "
                             f"({self.max_num_batched_tokens}) must be >= 1")
        setattr_ = object.__setattr__
        setattr_(self, "token_buckets", tuple(int(t) for t in self.token_buckets)
                 or default_token_buckets(self.max_num_batched_tokens))
        setattr_(self, "request_buckets", tuple(int(r) for r in self.request_buckets)
                 or default_request_buckets(self.max_num_seqs))
        _check_ladder("token_buckets", self.token_buckets, self.max_num_batched_tokens)
        _check_ladder("request_buckets", self.request_buckets, self.max_num_seqs)


@dataclasses.dataclass(frozen=True, slots=True)
class CacheConfig:
    """The logical KV cache.

    Attributes:
      block_size: S, tokens per block.
      num_kv_blocks: B including the null block; None = sized by the worker
        from ``kv_cache_bytes``.
      kv_cache_bytes: the KV cache budget when ``num_kv_blocks`` is None;
        None = sized by the worker: on a GPU / TPU from free device memory
        after the weights and the largest bucket's activations (times
        ``memory_utilization``), on CPU 1 GiB (``jaxserve.worker.kv_sizing``).
      memory_utilization: the fraction of device memory the worker may use
        when it sizes the cache itself.
      enable_prefix_caching: share full blocks between requests by a hash
        chain over their tokens.
      kv_cache_dtype: "auto" (the parameter dtype), "fp8" or "fp8_e4m3" (e4m3 with
        a scale per layer: a block takes 1 byte per element, so the same budget
        holds 2× a bfloat16 cache's tokens, 4× a float32 one's;
        ``WorkerInit.kv_cache_dtype``). vLLM's ``--kv-cache-dtype``.
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2 (block 0 is reserved), "
                             f"got {self.num_kv_blocks}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")
        if not 0.0 < self.memory_utilization <= 1.0:
            raise ValueError(f"memory_utilization must be in (0, 1], "
                             f"got {self.memory_utilization}")
        check_kv_cache_dtype(self.kv_cache_dtype)


@dataclasses.dataclass(frozen=True, slots=True)
class CompileConfig:
    """How the worker compiles its step executables (``jaxserve.worker.compile_manager``).

    Attributes:
      precompile: compile (or load from the persistent cache) every
        executable of the ladders at start-up and arm the recompile guard;
        False compiles lazily (development only).
      strict_recompile: a compile after warm-up raises ``RecompileError``
        (tests); otherwise it is logged and counted.
      cache_dir: JAX's persistent compilation cache directory for the worker
        (minimum compile time 0); None = JAX's own setting (e.g.
        ``JAX_COMPILATION_CACHE_DIR``).
    """

    precompile: bool = True
    strict_recompile: bool = False
    cache_dir: str | None = None


# The methods of ``SpeculativeConfig`` (vLLM's ``speculative_config["method"]``).
SPECULATIVE_METHODS = ("ngram", "draft_model")
# vLLM's defaults for ngram when neither prompt_lookup bound is given.
DEFAULT_PROMPT_LOOKUP = 5


@dataclasses.dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``--speculative-config``; docs/speculative_decoding.md).

    Attributes:
      method: "ngram" (prompt lookup: ``jaxserve.engine.ngram_proposer``) or
        "draft_model" (a smaller model sharing the tokenizer proposes k greedy
        tokens on the worker after each step: ``WorkerInit.draft_model``).
      num_speculative_tokens: k >= 1, the most draft tokens a sequence carries
        into one step.
      prompt_lookup_max / prompt_lookup_min: the longest / shortest suffix
        n-gram looked up, in tokens (ngram); as vLLM, one given alone sets
        both, and neither gives 5.
      model: the draft model's Hugging Face directory (draft_model only).

    Raises:
      ValueError: an unknown method (naming the supported ones), a value of the
        wrong type (an int is needed: not a float, a string, a bool or null),
        k < 1, bounds outside 1 <= min <= max, draft_model without a model or
        a model with another method.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method must be one of "
                             f"{', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config model (the draft model's directory) is "
                             "needed with method draft_model, and only with it; got method "
                             f"{self.method!r}, model {self.model!r}")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config model must be a directory path, got "
                             f"{self.model!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            optional = name != "num_speculative_tokens"
            if not (isinstance(value, int) and not isinstance(value, bool)) and not (
                    optional and value is None):
                raise ValueError(f"speculative_config {name} must be an integer, got "
                                 f"{value!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"speculative_config num_speculative_tokens must be >= 1, got "
                             f"{self.num_speculative_tokens}")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = DEFAULT_PROMPT_LOOKUP
        elif low is None:
            low = high
        elif high is None:
            high = low
        if not 1 <= low <= high:
            raise ValueError(f"speculative_config needs 1 <= prompt_lookup_min <= "
                             f"prompt_lookup_max, got {low} and {high}")
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

    @classmethod
    def from_dict(cls, config: dict) -> SpeculativeConfig:
        """From vLLM's ``speculative_config`` dict (the JSON of ``--speculative-config``);
        ``method`` is required, except that a ``model`` alone means "draft_model" (vLLM).

        Raises:
          ValueError: not a dict, no ``method``, a key this engine does not know (naming
            it), or a bad value.
        """
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict such as {{\"method\": "
                             f"\"ngram\", \"num_speculative_tokens\": 3}}, got "
                             f"{type(config).__name__} {config!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - fields)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(fields))}")
        if "method" not in config and "model" in config:
            config = {**config, "method": "draft_model"}
        if "method" not in config:
            raise ValueError(f"speculative_config needs a method (one of "
                             f"{', '.join(SPECULATIVE_METHODS)})")
        return cls(**config)

    def with_model_checked(self) -> SpeculativeConfig:
        """This config with a draft model's directory checked and made absolute (``~``
        expanded), so a bad path is refused at start-up, before any model loads.

        Raises:
          ValueError: the directory does not exist or has no config.json (naming
            ``speculative_config model``).
        """
        if self.model is None:
            return self
        from jaxserve.demo_model import resolve_model_path

        if not self.model:
            raise ValueError("speculative_config model is empty; give the draft model's "
                             "Hugging Face directory")
        try:
            path = resolve_model_path(self.model)
        except FileNotFoundError as err:
            raise ValueError(f"speculative_config model: {err}") from None
        return dataclasses.replace(self, model=str(path))

    @classmethod
    def of(cls, config: dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """``LLM``'s argument: None, a ``SpeculativeConfig``, or vLLM's dict (``from_dict``).

        Raises:
          ValueError: anything else (a JSON string included), or a bad dict.
        """
        return config if config is None or isinstance(config, cls) else cls.from_dict(config)


@dataclasses.dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine core needs.

    Attributes:
      model: Hugging Face model directory, or None for the demo model.
      tokenizer: the directory of the tokenizer structured outputs compile
        grammars against (``tokenizer.json``); None = ``model``'s.
      dtype: "float32", "bfloat16" (``SERVED_DTYPES``) or "auto" (default): the
        worker's choice, float32 on a CPU, bfloat16 on a GPU or TPU.
      max_model_len: longest sequence in tokens; None = the model's maximum.
      scheduler, cache: see their classes.
      attention_backend: None = the worker's platform default.
      seed: the server seed for unseeded sampling.
      async_scheduling: plan step N + 1 while the worker runs step N
        (``jaxserve.engine.core``; default on, as vLLM's).
      compile: see ``CompileConfig``.
      scan_layers: the worker runs the layers with ``jax.lax.scan``
        (``WorkerInit.scan_layers``).
      tensor_parallel_size: devices the worker splits the model over
        (``WorkerInit.tensor_parallel_size``).
      load_format: how the worker reads the weights (``WorkerInit.load_format``).
      quantization: None (the checkpoint's weights), "int8", "int4" or "fp8" (vLLM's
        flag: weight-only int8 / group-wise int4, or e4m3 weights and activations,
        quantized at load time, ``WorkerInit.quantization``; int4 only with
        ``tensor_parallel_size`` 1; fp8 only on a GPU of compute capability >= 8.9,
        which the worker checks). A pre-quantized checkpoint's method replaces None
        in ``for_checkpoint``.
      speculative_config: speculative decoding, or None (off). With it the
        engine schedules synchronously (a step's drafts need the tokens of the
        step before).
      eos_token_ids: filled from the worker's geometry by ``resolved``.
    """

    model: str | None = None
    dtype: str = AUTO_DTYPE
    max_model_len: int | None = None
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    attention_backend: str | None = None
    seed: int = 0
    async_scheduling: bool = True
    compile: CompileConfig = dataclasses.field(default_factory=CompileConfig)
    scan_layers: bool = False
    tensor_parallel_size: int = 1
    load_format: str = "auto"
    quantization: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    tokenizer: str | None = None
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got "
                             f"{self.tensor_parallel_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.dtype not in (*SERVED_DTYPES, AUTO_DTYPE):
            raise ValueError(f"dtype must be one of {', '.join(SERVED_DTYPES)} or auto, got "
                             f"{self.dtype!r} (float16 is not served: the GPU attention "
                             f"kernel takes float32 and bfloat16 only)")
        check_quantization(self.quantization,
                           tensor_parallel_size=self.tensor_parallel_size)

    def for_checkpoint(self) -> "EngineConfig":
        """A new config whose ``quantization`` is the one the model is served with: a
        pre-quantized checkpoint's own method ("fp8" for a compressed-tensors fp8
        directory) when ``quantization`` is None or that method
        (``compressed_tensors.resolve_quantization``, which the worker and the loader call
        too), else ``quantization`` as given.

        Raises:
          ValueError: a ``quantization_config`` jaxserve does not load, or another method
            asked of a pre-quantized checkpoint.
        """
        quantization = resolve_quantization(self.model, self.quantization,
                                            self.tensor_parallel_size)
        if quantization == self.quantization:
            return self
        return dataclasses.replace(self, quantization=quantization)

    def worker_init(self) -> WorkerInit:
        """The ``initialize`` request for the worker."""
        return WorkerInit(
            model=self.model, dtype=self.dtype, block_size=self.cache.block_size,
            num_kv_blocks=self.cache.num_kv_blocks, kv_cache_bytes=self.cache.kv_cache_bytes,
            max_num_seqs=self.scheduler.max_num_seqs, max_model_len=self.max_model_len,
            token_buckets=self.scheduler.token_buckets,
            request_buckets=self.scheduler.request_buckets,
            attention_backend=self.attention_backend, seed=self.seed,
            memory_utilization=self.cache.memory_utilization,
            precompile=self.compile.precompile, strict_recompile=self.compile.strict_recompile,
            compilation_cache_dir=self.compile.cache_dir, scan_layers=self.scan_layers,
            tensor_parallel_size=self.tensor_parallel_size, load_format=self.load_format,
            quantization=self.quantization, kv_cache_dtype=self.cache.kv_cache_dtype,
            **self._draft_init())

    def _draft_init(self) -> dict:
        spec = self.speculative_config
        if spec is None or spec.method != "draft_model":
            return {}
        return {"draft_model": spec.model, "num_speculative_tokens": self.max_drafts}

    @property
    def max_drafts(self) -> int:
        """The most drafts one sequence can carry into a step: k, capped by the R ladder's
        top less the sequence's own slot (each draft is a sampling slot), at least 1."""
        spec = self.speculative_config
        k = spec.num_speculative_tokens if spec is not None else 0
        return max(1, min(k, self.scheduler.request_buckets[-1] - 1))

    def resolved(self, geometry: Geometry) -> "EngineConfig":
        """A new config with the worker's geometry filled in.

        Raises:
          ValueError: the geometry disagrees with the request (block size), or
            one sequence of ``max_model_len`` tokens would not fit the cache
            (``jaxserve.config.check_kv_cache_fits``).
        """
        if geometry.block_size != self.cache.block_size:
            raise ValueError(f"worker block size {geometry.block_size} != "
                             f"{self.cache.block_size}")
        check_kv_cache_fits(geometry.num_kv_blocks, geometry.block_size, geometry.max_model_len)
        return dataclasses.replace(
            self, max_model_len=geometry.max_model_len, eos_token_ids=geometry.eos_token_ids,
            cache=dataclasses.replace(self.cache, num_kv_blocks=geometry.num_kv_blocks))
