"""Generated tokens to text deltas, with stop strings cut out.

Two things make this more than `decode(token)`: a multi-byte UTF-8 character can be split over
tokens (the tokenizer's `IncrementalDetokenizer` holds it back until complete), and a stop string
can arrive over several tokens, so text that might be the start of one is held back until it
either completes the stop string (then generation ends and the stop string is never sent) or
cannot anymore. The concatenation of all deltas is always exactly the final `text`.
"""

from __future__ import annotations

from typing import Any


class CompletionText:
    """The text side of one request's completion. Without a tokenizer every delta is ""."""

    def __init__(self, tokenizer: Any | None, stop: tuple[str, ...] = ()) -> None:
        self._detok = tokenizer.detokenizer() if tokenizer is not None else None
        self._stop = stop
        self._longest_stop = max((len(s) for s in stop), default=0)
        self._full = ""  # everything decoded so far
        self._sent = 0  # chars of _full handed out as deltas
        self._cut: int | None = None  # where a stop string starts, once one matched

    @property
    def text(self) -> str:
        """The completion as sent (or to be sent): up to the stop string when one matched."""
        return self._full if self._cut is None else self._full[: self._cut]

    @property
    def stopped(self) -> bool:
        """True once a stop string appeared: generation must end with this token."""
        return self._cut is not None

    def add(self, token_id: int) -> str:
        """Feed one generated token; returns the text that is now safe to send."""
        if self._detok is None or self._cut is not None:
            return ""
        return self._extend(self._detok.add(token_id), final=False)

    def finish(self) -> str:
        """Generation ended: flush what the detokenizer and the stop matcher held back."""
        if self._detok is None or self._cut is not None:
            return ""
        return self._extend(self._detok.flush(), final=True)

    def _extend(self, new: str, final: bool) -> str:
        scan_from = max(0, len(self._full) - self._longest_stop + 1)
        self._full += new
        cut = min((p for p in (self._full.find(s, scan_from) for s in self._stop) if p >= 0), default=None)
        if cut is not None:
            self._cut = cut
            end = cut
        else:
            end = len(self._full) if final else len(self._full) - self._held_back()
        end = max(end, self._sent)
        delta, self._sent = self._full[self._sent : end], end
        return delta

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(self._full)), best, -1):
                if self._full.endswith(s[:k]):
                    best = k
                    break
        return best
