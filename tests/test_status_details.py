"""``jaxserve.status_details``: a gRPC status's text keeps its beginning, bounded in UTF-8 bytes."""

from __future__ import annotations

import pytest

from jaxserve.status_details import MAX_DETAILS_BYTES, error_details, status_details


def test_a_short_text_passes_unchanged():
    text = "step 3: RuntimeError: out of memory\nsecond line"
    assert status_details(text) == text
    exact = "é" * (MAX_DETAILS_BYTES // 2)  # 2 bytes each: exactly the limit
    assert status_details(exact) == exact


@pytest.mark.parametrize("char", ["x", "é", "€", "🙂"])  # 1 to 4 UTF-8 bytes
def test_a_long_text_keeps_its_head_within_the_limit(char):
    head = "initialize: RuntimeError: the first line\n"
    text = head + char * 50_000
    out = status_details(text)
    size = len(out.encode("utf-8"))  # encodes: no character was split
    assert MAX_DETAILS_BYTES - 4 - 200 < size <= MAX_DETAILS_BYTES
    assert out.startswith(head)
    kept = len(out.split(" [... ")[0].encode())
    assert out.endswith(f" [... {len(text.encode()) - kept} more bytes cut: "
                        f"{len(text.encode())} in all; the full text is in the log of the "
                        f"process that raised it]")


def test_error_details_names_what_failed_and_the_type():
    err = RuntimeError("Cannot serialize code with custom calls\n" + "HLO " * 10_000)
    out = error_details("step 12", err, limit=512)
    assert out.startswith("step 12: RuntimeError: Cannot serialize code with custom calls\nHLO ")
    assert len(out.encode()) <= 512
    with pytest.raises(ValueError, match="255"):
        status_details("x", limit=255)
