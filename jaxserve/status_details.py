"""The text of a gRPC status: an error's type and first lines, bounded (jax-free).

A status's details travel as HTTP/2 trailing metadata, and gRPC refuses
metadata over its hard limit (16 KiB by default): a longer text does not
arrive as itself but as "Stream removed (received metadata size exceeds hard
limit ...) (RESOURCE_EXHAUSTED)", which hides the cause. An XLA or JAX error
can be tens of kilobytes (a whole HLO module), so every ``context.abort``
that carries an error's text — in the worker, engine and api processes —
passes it through ``status_details`` (or ``error_details``), once per
process hop: an error relayed from the worker through the engine to the api
process and on to the client stays bounded at every hop. The full text and
traceback stay in the log of the process that raised it.
"""

from __future__ import annotations

# Bytes of details a status carries at most: the error's type and first
# lines fit; far below gRPC's 16 KiB metadata limit, prefixes added by the
# next hop included.
MAX_DETAILS_BYTES = 2048


def status_details(text: str, limit: int = MAX_DETAILS_BYTES) -> str:
    """``text`` bounded to ``limit`` UTF-8 bytes for a gRPC status's details.

    A longer text keeps its beginning (whole characters) and ends with a
    note giving the size cut off.

    Raises:
      ValueError: ``limit`` < 256 (no room for the note and a first line).
    """
    if limit < 256:
        raise ValueError(f"limit must be >= 256 bytes, got {limit}")
    data = text.encode("utf-8", errors="replace")
    if len(data) <= limit:
        return text
    note = (f" [... {{}} more bytes cut: {len(data)} in all; the full text is in the log "
            f"of the process that raised it]")
    keep = limit - len(note.format(len(data)).encode())
    head = data[:keep].decode("utf-8", errors="ignore").rstrip()
    return head + note.format(len(data) - len(head.encode()))


def error_details(what: str, err: BaseException, limit: int = MAX_DETAILS_BYTES) -> str:
    """``"<what>: <ErrorType>: <message>"`` bounded by ``status_details``.

    Args:
      what: the operation that failed ("initialize", "step 12").
      err: the exception raised.
      limit: UTF-8 bytes at most.
    """
    return status_details(f"{what}: {type(err).__name__}: {err}", limit)
