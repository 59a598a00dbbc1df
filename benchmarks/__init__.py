"""jaxserve benchmarks: ``jaxserve bench <name>`` or ``python -m benchmarks.<name>``.

- ``offline_throughput``: ``jaxserve.LLM`` against transformers' ``generate``
  (and vLLM when a vLLM Python is given) on the same prompts;
- ``serving``: a Poisson / max-concurrency load generator against a server;
- ``step_profile``: where the time of each engine step goes, from a JAX profiler trace;
- ``decode_roofline``: batch-1 decode step time against the weight-streaming floor;
- ``cpu_side_by_side``: every engine (jaxserve, transformers, vLLM, llama.cpp) on
  batch 1 / 16 / 64, the mix and a 512-token prefill in one run, with ratios;
- ``structured_outputs``: tokens/s of a batch with half its rows JSON-schema
  constrained against the same batch unconstrained, and grammar compile times.

See docs/benchmarks.md. ``kernels/`` and ``sampler_bench.py`` are micro-benchmarks.
"""

BENCHMARKS = ("offline_throughput", "serving", "step_profile", "decode_roofline",
              "cpu_side_by_side", "structured_outputs", "speculative")
