"""Bearer tokens: the API keys clients present to the gateway and the join token that workers and gateways present
to the coordinator (and the coordinator and gateways to the workers).

Both travel the same way, as `authorization: Bearer <token>` (gRPC metadata, or the HTTP header), and are checked
the same way, by a `TokenSource`: the accepted values come from a file (one per line; blank lines and `#`
comments skipped), re-read when it changes, and from an environment variable. A presented token is compared with
every accepted one in constant time (`hmac.compare_digest` over SHA-256 digests, so neither the position of the
first differing byte nor the length of a key shows in the time taken), and only digests are kept. No token is
ever logged: a refusal says which credential was missing or not accepted, never how close a guess came.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any


class TokenError(ValueError):
    """A token file or value that cannot be used; the message names the flag."""


class Verdict(enum.Enum):
    OK = "ok"
    MISSING = "missing"  # no `authorization: Bearer ...` at all: UNAUTHENTICATED, HTTP 401
    WRONG = "wrong"  # a bearer token that is not accepted: PERMISSION_DENIED, HTTP 403


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def parse_lines(text: str) -> list[str]:
    """The tokens of a token file: one per line, surrounding blanks stripped, blank lines and `#` comments skipped."""
    return [s for line in text.splitlines() if (s := line.strip()) and not s.startswith("#")]


def read_file(path: str | Path, flag: str) -> list[str]:
    """The tokens in `path`, at least one; raises `TokenError` naming `flag` otherwise."""
    try:
        tokens = parse_lines(Path(path).read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise TokenError(f"{flag}: cannot read {path}: {e}") from None
    if not tokens:
        raise TokenError(f"{flag}: {path} holds no token (one per line; # starts a comment)")
    return tokens


class TokenSource:
    """The tokens a server accepts, checked in constant time; a file given is re-read when it changes.

    `what` names the credential in refusals ("API key", "join token"). A file that becomes unreadable or empty
    keeps the tokens last read from it (logged once), so a rotation half-way through never locks everyone out;
    to revoke a token, remove its line.
    """

    def __init__(self, what: str, values: Iterable[str] = (), file: str | Path | None = None, *, flag: str = "",
                 logger: Any = None) -> None:  # fmt: skip
        self.what = what
        self._fixed = [_digest(v) for v in values if v]
        self._file = Path(file) if file else None
        self._flag = flag
        self._log = logger
        self._lock = threading.Lock()
        self._from_file: list[bytes] = []
        self._stamp: tuple[int, int, int] | None = None
        if self._file is not None:
            self._from_file = [_digest(t) for t in read_file(self._file, flag)]
            self._stamp = self._file_stamp()
        if not self._fixed and not self._from_file:
            raise TokenError(f"{flag or what}: no token given")

    @classmethod
    def optional(cls, what: str, values: Iterable[str] = (), file: str | Path | None = None, *, flag: str = "",
                 logger: Any = None) -> TokenSource | None:  # fmt: skip
        """A source when any value or a file is given, else None (nothing is required)."""
        values = [v for v in values if v]
        return cls(what, values, file, flag=flag, logger=logger) if values or file else None

    @property
    def refusals(self) -> dict[Verdict, str]:
        """The message a refusal carries, by verdict: which credential is missing or not accepted, nothing more."""
        placeholder = "key" if self.what.endswith("key") else "token"
        return {Verdict.MISSING: f"no {self.what}: send authorization: Bearer <{placeholder}>",
                Verdict.WRONG: f"{self.what} not accepted"}  # fmt: skip

    def check(self, authorization: str | None) -> Verdict:
        """The verdict on an `authorization` header or metadata value (None: absent)."""
        if not authorization:
            return Verdict.MISSING
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return Verdict.MISSING
        presented = _digest(token)
        accepted = False
        for digest in self._accepted():  # every one compared, whichever matches
            accepted |= hmac.compare_digest(presented, digest)
        return Verdict.OK if accepted else Verdict.WRONG

    def _accepted(self) -> list[bytes]:
        if self._file is None:
            return self._fixed
        with self._lock:
            try:
                stamp = self._file_stamp()
            except OSError:
                stamp = None
            if stamp is not None and stamp != self._stamp:
                self._stamp = stamp
                try:
                    self._from_file = [_digest(t) for t in read_file(self._file, self._flag)]
                    if self._log is not None:
                        self._log.info("tokens_reloaded", what=self.what, file=str(self._file),
                                       count=len(self._from_file))  # fmt: skip
                except TokenError as e:
                    if self._log is not None:
                        self._log.warning("tokens_reload_skipped", what=self.what, error=str(e))
            return self._fixed + self._from_file

    def _file_stamp(self) -> tuple[int, int, int]:
        assert self._file is not None
        st = os.stat(self._file)
        return st.st_mtime_ns, st.st_size, st.st_ino


def presented(value: str | None, file: str | None, flag: str) -> str | None:
    """The token a client presents: the first line of `file`, else `value` (from the environment), else None."""
    if file:
        return read_file(file, flag)[0]
    return value.strip() if value and value.strip() else None


def env_value(name: str) -> str | None:
    """An environment variable holding a token, or None when unset or blank."""
    value = os.environ.get(name, "").strip()
    return value or None
