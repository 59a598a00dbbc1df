"""Python client of the jaxserve gRPC service (``proto/jaxserve/generate.proto``).

::

    from jaxserve.client import Client

    with Client("localhost:50051", timeout=60) as client:
        for delta in client.stream(messages=[{"role": "user", "content": "Hi!"}],
                                   temperature=0, max_tokens=64):
            print(delta.text, end="", flush=True)
        result = client.generate("The capital of France is", max_tokens=8)
        result.text, result.token_ids, result.finish_reason, result.usage

``AsyncClient`` has the same methods as coroutines (``stream`` is an async
iterator). Failures raise ``JaxServeError`` with ``.code`` (a
``grpc.StatusCode``) and ``.message`` (the server's). Never imports jax.
"""

from jaxserve.client.aio import AsyncClient
from jaxserve.client.sync import DEFAULT_TARGET, Client
from jaxserve.client.types import (Completion, GenerateResult, JaxServeError, ModelInfo,
                                   StreamDelta, TokenizeResult, TokenLogprobs, ToolCall, Usage)

__all__ = ["AsyncClient", "Client", "Completion", "DEFAULT_TARGET", "GenerateResult",
           "JaxServeError", "ModelInfo", "StreamDelta", "TokenizeResult", "TokenLogprobs",
           "ToolCall", "Usage"]
