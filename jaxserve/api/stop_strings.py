"""Stop strings matched on a completion's detokenized text, as it streams.

The engine only sees token ids; stop *strings* are matched here, on the text
the detokenizer emits, so a stop string may span several tokens or start in
the middle of one. ``StopStringMatcher.push(text)`` takes each new piece of
text and returns what may be shown now:

- while the end of the text could still grow into a stop string, that end is
  held back: the longest suffix that is a proper prefix of some stop string,
  so at most ``max(len(stop)) - 1`` characters (nothing when it cannot be
  the start of any stop string);
- when a stop string completes, the text is cut at its start (or its end
  with ``include_stop_str_in_output``), the held-back text up to the cut is
  released, and the matched stop string is reported; text after it is dropped.

Which stop string wins: the first to complete reading left to right (the
smallest end position), and of those ending at the same place the longest.
So the result does not depend on how the text was split into pieces.
With ``include_stop_str_in_output`` nothing is held back (text before a stop
string's end is shown either way).

``armed=False`` pushes (used for ``min_tokens``) add text without matching;
a later armed push matches only stop strings that end in the new text, as
vLLM does (a stop string may still start in the unarmed text).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class StopMatch(NamedTuple):
    """What ``push`` releases: ``text`` to show now, and the matched stop string or None."""

    text: str
    stop: str | None


class StopStringMatcher:
    """Matches stop strings on one completion's text, holding back possible beginnings.

    Args:
      stop: the stop strings (non-empty strings; duplicates ignored).
      include_stop_str_in_output: keep the matched stop string in the text.

    After a match every later ``push`` returns ``StopMatch("", None)``.
    ``flush()`` releases the held-back text when the completion ends otherwise.

    Raises:
      ValueError: an empty stop string.
    """

    def __init__(self, stop: Sequence[str] = (), *,
                 include_stop_str_in_output: bool = False) -> None:
        self._stops = tuple(dict.fromkeys(stop))
        for s in self._stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r}")
        self._include = include_stop_str_in_output
        self._max_len = max((len(s) for s in self._stops), default=0)
        # Only a short window of the text is kept: _buf is text[_base:]. Indices
        # below are absolute positions in the whole pushed text.
        self._buf = ""
        self._base = 0
        self._parts: list[str] = []  # the released pieces
        self._released = 0  # characters released so far
        self._checked = 0  # stop strings ending at or before this index were looked for
        self._matched: str | None = None

    @property
    def matched(self) -> str | None:
        """The stop string that ended the text, or None."""
        return self._matched

    @property
    def text(self) -> str:
        """All text released so far (the final text once matched or flushed)."""
        return "".join(self._parts)

    def push(self, text: str, *, armed: bool = True) -> StopMatch:
        """Appends ``text``; returns what can be shown now and the stop string if one completed."""
        if self._matched is not None or not text:
            return StopMatch("", None)
        self._buf += text
        end = self._base + len(self._buf)
        if armed and self._stops:
            found = self._find_match()
            if found is not None:
                start, stop = found
                cut = start + len(stop) if self._include else start
                self._buf = self._buf[:cut - self._base]
                self._matched = stop
                return StopMatch(self._release(cut), stop)
        self._checked = end
        out = self._release(end - self._hold_back())
        self._trim()
        return StopMatch(out, None)

    def flush(self) -> str:
        """Releases the held-back text (the completion ended without a match)."""
        return self._release(self._base + len(self._buf))

    def _release(self, end: int) -> str:
        end = max(end, self._released)
        out = self._buf[self._released - self._base:end - self._base]
        self._released = end
        if out:
            self._parts.append(out)
        return out

    def _trim(self) -> None:
        """Drops text that is released and too far back to be part of a future match."""
        keep_from = min(self._released, max(0, self._checked - self._max_len + 1))
        if keep_from > self._base:
            self._buf = self._buf[keep_from - self._base:]
            self._base = keep_from

    def _find_match(self) -> tuple[int, str] | None:
        """(start, stop) of the stop string ending first after ``_checked``, longest on ties."""
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for stop in self._stops:
            start = max(0, self._checked - len(stop) + 1)
            found = self._buf.find(stop, start - self._base)
            if found < 0:
                continue
            key = (self._base + found + len(stop), -len(stop), stop)
            if best is None or key[:2] < best[:2]:
                best = key
        if best is None:
            return None
        end, neg_len, stop = best
        return end + neg_len, stop

    def _hold_back(self) -> int:
        """Characters at the end of the text that could begin a stop string."""
        if self._include:
            return 0
        buf = self._buf
        unreleased = self._base + len(buf) - self._released
        for k in range(min(self._max_len - 1, unreleased), 0, -1):
            suffix = buf[len(buf) - k:]
            if any(s.startswith(suffix) for s in self._stops):
                return k
        return 0
