"""jaxserve.client.AsyncClient (grpc.aio) against the scripted loopback server.

The same wire behaviour as the blocking client: streamed deltas, results,
errors with code and message, deadlines, cancellation, concurrency, health.
Each test runs its own event loop (``asyncio.run``); no pytest plugin needed.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from jaxserve.client import AsyncClient, JaxServeError
from tests.api.fake_generate_server import NOT_SERVING_SERVICE, FakeServer


@pytest.fixture(scope="module")
def server():
    fake = FakeServer()
    yield fake
    fake.stop()


def run(server, body, **kwargs):
    async def main():
        async with AsyncClient(server.target, **kwargs) as client:
            return await body(client)
    return asyncio.run(main())


def test_stream_and_generate(server):
    async def body(client):
        deltas = [d async for d in client.stream("héllo 😀", max_tokens=32)]
        result = await client.generate("héllo 😀", max_tokens=3)
        return deltas, result

    deltas, result = run(server, body, timeout=10)
    assert [d.text for d in deltas[:-1]] == list("héllo 😀")
    assert deltas[-1].finished and deltas[-1].finish_reason == "stop"
    assert (result.text, result.finish_reason) == ("hél", "length")
    assert server.servicer.requests[-1].stream is False


def test_chat_tokenize_model_info_health(server):
    async def body(client):
        return (await client.chat([("user", "hi")]), await client.tokenize("ab"),
                await client.model_info(), await client.health(),
                await client.health(NOT_SERVING_SERVICE))

    chat, tokens, info, health, not_serving = run(server, body, timeout=10)
    assert chat.text == "user: hi\n"
    assert tokens.token_ids == (97, 98)
    assert info.num_kv_blocks_total == 9
    assert (health, not_serving) == ("SERVING", "NOT_SERVING")


@pytest.mark.parametrize("streamed", [False, True])
def test_errors_carry_code_and_message(server, streamed):
    async def body(client):
        prompt = "!error RESOURCE_EXHAUSTED the waiting queue is full (64 requests)"
        if streamed:
            return [d async for d in client.stream(prompt)]
        return await client.generate(prompt)

    with pytest.raises(JaxServeError) as info:
        run(server, body, timeout=10)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.message == "the waiting queue is full (64 requests)"


def test_deadline_exceeded(server):
    async def body(client):
        with pytest.raises(JaxServeError) as info:
            await client.generate("!sleep 5", timeout=0.3)
        with pytest.raises(JaxServeError) as stream_info:
            async for _ in client.stream("!sleep 5", timeout=0.3):
                pass
        return info.value.code, stream_info.value.code

    start = time.monotonic()
    assert run(server, body) == (grpc.StatusCode.DEADLINE_EXCEEDED,) * 2
    assert time.monotonic() - start < 4


def test_closing_a_stream_cancels_the_call(server):
    server.servicer.cancelled.clear()

    async def body(client):
        stream = client.stream("!forever")
        texts = [(await stream.__anext__()).text for _ in range(3)]
        await stream.aclose()
        return texts

    assert run(server, body, timeout=10) == ["x"] * 3
    assert server.servicer.cancelled.wait(5)


def test_concurrent_streams(server):
    prompts = [f"prompt {i} 世界" for i in range(16)]

    async def collect(client, prompt):
        return "".join([d.text async for d in client.stream(prompt)])

    async def body(client):
        return await asyncio.gather(*(collect(client, p) for p in prompts))

    assert run(server, body, timeout=10) == prompts


def test_wait_ready_waits_for_serving():
    starting = FakeServer(starting=True)

    async def main():
        async with AsyncClient(starting.target, timeout=10) as client:
            with pytest.raises(JaxServeError) as info:
                await client.wait_ready(timeout=0.3)
            assert "NOT_SERVING" in info.value.message
            asyncio.get_running_loop().call_later(0.3, starting.start_serving)
            await client.wait_ready(timeout=30)
            assert starting.servicer.serving.is_set()
            return await client.generate("hello", max_tokens=2)

    try:
        assert asyncio.run(main()).text == "he"
    finally:
        starting.stop()
