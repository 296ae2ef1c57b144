"""Mutual TLS for every gRPC hop of the mesh, built in this one place: the servers' credentials (which require a
client certificate signed by the mesh's CA), the channels' credentials, and `Dial`, how a process dials its peers.

Every service is given three PEM files (`--tls-cert`, `--tls-key`, `--tls-ca`): its certificate, which it presents
both as a server and as a client, the certificate's private key, and the CA that signs every certificate of the
mesh. A peer whose certificate that CA did not sign, or that has none, is refused during the TLS handshake, before
any RPC reaches a handler. `shardmesh certs init DIR` makes such a CA and a certificate per service.

What is reloaded, and when:
- A server re-reads its certificate, key and CA when any of the three files changes (size, modification time or
  inode): gRPC asks `_ServerFiles.fetch` at every new connection's handshake, which compares the files' stamps
  and hands gRPC the new pair once it loads and matches. Connections already open keep the certificate they were
  opened with; a half-written replacement (a new certificate beside the old key) is skipped until it is whole.
- A channel reads the files when it is made; `grpc.ssl_channel_credentials` cannot re-read them. So a replaced
  client certificate is presented by the channels a process makes after the change (the tools, at every run;
  a gateway's channel to a worker address it has not dialled before), and by the long-lived channels (a worker's
  and a gateway's to the coordinator, the gateway's to the workers it knows) at the process's next restart. A
  server certificate signed by the same CA needs no client change at all: clients check it against the CA.
- The HTTPS front of the gateway re-reads its certificate and key the same way (`https_context`).
"""

from __future__ import annotations

import os
import ssl
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from shardmesh.rpc.interceptors import BearerToken

FLAGS = ("--tls-cert", "--tls-key", "--tls-ca")  # the flags every service and tool has (`shardmesh.rpc.flags`)


class TlsError(ValueError):
    """TLS files that cannot be used; the message names the flag (`--tls-key: ...`)."""


Stamp = tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class TlsFiles:
    """The three PEM files of one service: its certificate (chain), its private key, and the mesh's CA."""

    cert: Path
    key: Path
    ca: Path

    @classmethod
    def from_flags(cls, cert: str | None, key: str | None, ca: str | None) -> TlsFiles | None:
        """The files `--tls-cert`, `--tls-key` and `--tls-ca` name: all three, or none (None: plaintext).

        Checked now, so a service with unusable files refuses to start with one line naming the flag: each file
        must be readable, the key must match the certificate, and the CA must load."""
        given = dict(zip(FLAGS, (cert, key, ca), strict=True))
        if not any(given.values()):
            return None
        missing = [f for f, v in given.items() if not v]
        if missing:
            have = ", ".join(f for f, v in given.items() if v)
            raise TlsError(f"{missing[0]}: needed with {have} (mutual TLS takes a certificate, its key and the CA)")
        files = cls(Path(cert), Path(key), Path(ca))  # type: ignore[arg-type]
        files.check()
        return files

    def check(self) -> None:
        """Raise `TlsError` naming the flag unless the files load as a certificate, its key and a CA."""
        for name, path in zip(FLAGS, (self.cert, self.key, self.ca), strict=True):
            if not path.is_file() or not os.access(path, os.R_OK):
                raise TlsError(f"{name}: cannot read {path}")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(self.cert, self.key)
        except ssl.SSLError as e:
            raise TlsError(
                f"--tls-key: {self.key} is not the private key of --tls-cert {self.cert} ({e.reason})"
            ) from None
        try:
            context.load_verify_locations(cafile=str(self.ca))
        except ssl.SSLError as e:
            raise TlsError(f"--tls-ca: {self.ca} holds no CA certificate ({e.reason})") from None

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(certificate chain, private key, CA) as bytes, read now."""
        return self.cert.read_bytes(), self.key.read_bytes(), self.ca.read_bytes()

    def stamp(self) -> Stamp:
        """What changes when any of the files is replaced or rewritten (raises OSError while one is missing)."""
        out = []
        for path in (self.cert, self.key, self.ca):
            st = os.stat(path)
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(out)

    def as_flags(self) -> list[str]:
        return ["--tls-cert", str(self.cert), "--tls-key", str(self.key), "--tls-ca", str(self.ca)]


def from_args(args: Any) -> TlsFiles | None:
    """`TlsFiles.from_flags` over a parsed namespace's `tls_cert`, `tls_key`, `tls_ca`."""
    return TlsFiles.from_flags(getattr(args, "tls_cert", None), getattr(args, "tls_key", None),
                               getattr(args, "tls_ca", None))  # fmt: skip


# -- servers ------------------------------------------------------------------------------------------------------


class _ServerFiles:
    """The certificate configuration a server hands gRPC, re-read when the files change (see the module's doc)."""

    def __init__(self, files: TlsFiles, logger: Any = None) -> None:
        self._files = files
        self._log = logger
        self._lock = threading.Lock()
        self._stamp = files.stamp()
        self._skipped: Stamp | None = None  # a stamp whose files did not load: logged once, retried when they change
        self.initial = self._configuration()

    def _configuration(self) -> Any:
        cert, key, ca = self._files.read()
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch(self) -> Any:
        """Called by gRPC at each new connection's handshake: a new configuration when the files changed, else None
        (keep the current one)."""
        with self._lock:
            try:
                stamp = self._files.stamp()
            except OSError:
                return None  # a file is being replaced right now: keep serving the current pair
            if stamp == self._stamp or stamp == self._skipped:
                return None
            try:
                self._files.check()
                configuration = self._configuration()
            except (TlsError, OSError) as e:
                self._skipped = stamp
                if self._log is not None:
                    self._log.warning("tls_reload_skipped", error=str(e))
                return None
            self._stamp, self._skipped = stamp, None
        if self._log is not None:
            self._log.info("tls_reloaded", cert=str(self._files.cert))
        return configuration


def server_credentials(files: TlsFiles, logger: Any = None) -> grpc.ServerCredentials:
    """Credentials for `server.add_secure_port`: TLS with the service's certificate, a client certificate signed
    by the CA required of every peer, and both re-read when the files change."""
    source = _ServerFiles(files, logger)
    return grpc.dynamic_ssl_server_credentials(source.initial, source.fetch, require_client_authentication=True)


# -- channels -----------------------------------------------------------------------------------------------------


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    """Credentials for a channel: the server's certificate checked against the CA, ours presented (read now)."""
    cert, key, ca = files.read()
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def channel(target: str, tls: TlsFiles | None = None, options: Sequence[tuple[str, Any]] = (),
            token: str | None = None) -> grpc.Channel:  # fmt: skip
    """A channel to `target`: mutual TLS with `tls` (plaintext without), and every call carrying `authorization:
    Bearer <token>` when a `token` is given (a join token, or a client's API key)."""
    options = list(options)
    if tls is not None:
        made = grpc.secure_channel(target, channel_credentials(tls), options)
    else:
        made = grpc.insecure_channel(target, options)
    return grpc.intercept_channel(made, BearerToken(token)) if token else made


@dataclass(frozen=True)
class Dial:
    """How a process dials its peers: its TLS files (None: plaintext), the token its calls carry (None: none) and
    the channel options (message limits). Services make one at start and hand it to whatever opens channels."""

    tls: TlsFiles | None = None
    token: str | None = field(default=None, repr=False)
    options: tuple[tuple[str, Any], ...] = ()

    def channel(self, target: str) -> grpc.Channel:
        return channel(target, self.tls, self.options, self.token)


# -- HTTPS --------------------------------------------------------------------------------------------------------


def https_context(files: TlsFiles, logger: Any = None) -> ssl.SSLContext:
    """A server-side `ssl.SSLContext` with the service's certificate, for the gateway's HTTP API. Clients need no
    certificate there (they present an API key instead). The certificate and key are re-read when they change:
    at each handshake a callback compares the files' stamps and, after a change, moves the connection onto a
    context loaded from the new files (OpenSSL calls it for every ClientHello, with or without SNI)."""
    current = _https_context(files)
    state = {"stamp": files.stamp(), "context": current}
    lock = threading.Lock()

    def on_hello(sock: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, context: ssl.SSLContext) -> None:
        with lock:
            try:
                stamp = files.stamp()
                if stamp != state["stamp"]:
                    state["stamp"] = stamp
                    state["context"] = _https_context(files)
                    if logger is not None:
                        logger.info("tls_reloaded", cert=str(files.cert), api="http")
            except (OSError, ssl.SSLError) as e:  # half-replaced files: keep the last good context
                if logger is not None:
                    logger.warning("tls_reload_skipped", error=str(e), api="http")
            if state["context"] is not current:
                sock.context = state["context"]

    current.sni_callback = on_hello
    return current


def _https_context(files: TlsFiles) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(files.cert, files.key)
    return context
