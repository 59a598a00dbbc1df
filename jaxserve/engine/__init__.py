"""The engine: requests, scheduler, logical KV blocks, step plans. Never imports jax.

See docs/engine.md. Entry point: ``EngineCore(EngineConfig(...), worker)``.
"""

from jaxserve.engine.config import (CacheConfig, CompileConfig, EngineConfig, SchedulerConfig,
                                    SpeculativeConfig)
from jaxserve.engine.core import EngineCore
from jaxserve.engine.messages import (EngineCoreOutput, EngineCoreRequest, EngineStats,
                                      SampleLogprobs)

__all__ = ["CacheConfig", "CompileConfig", "EngineConfig", "EngineCore", "EngineCoreOutput", "EngineCoreRequest",
           "EngineStats", "SampleLogprobs", "SchedulerConfig", "SpeculativeConfig"]
