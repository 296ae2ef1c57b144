"""`shardmesh certs init DIR`: a development CA and a certificate per service, for a mesh that runs mutual TLS;
`shardmesh certs issue DIR NAME`: one more certificate (or a replacement) signed by that CA.

What `init` writes (keys readable by their owner only):

    ca.pem, ca.key                    the mesh's CA: every service trusts exactly the certificates it signed
    coordinator.pem, coordinator.key  a certificate per service, for serving and for dialling its peers
    gateway.pem, gateway.key
    worker.pem, worker.key            one for every worker (each may have its own: `certs issue DIR worker-3`)
    client.pem, client.key            for the tools (status, drain, top, generate --gateway) and gRPC clients

Service certificates name 127.0.0.1, ::1 and localhost, plus every `--host` (a DNS name or an IP address; a
wildcard such as `*.workers.example.svc` covers workers whose names are not known in advance), as subject
alternative names: a client checks that the address it dials is one of them. They may act as TLS server and
client; the client certificate only as a client. Keys are ECDSA P-256. This is a development CA: for production,
issue the certificates from your own PKI (cert-manager, Vault, ...) and give the services the same three flags.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardmesh.rpc.flags import UsageError

SERVICES = ("coordinator", "gateway", "worker")
CLIENT = "client"
DEFAULT_HOSTS = ("127.0.0.1", "::1", "localhost")
DEFAULT_DAYS = 365


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="certs_command", required=True)
    init = sub.add_parser("init", help="make a development CA and a certificate per service in DIR")
    init.add_argument("dir", metavar="DIR", help="where the PEM files go (created if missing)")
    init.add_argument("--host", action="append", default=[],
                      help="another name or IP address the services are reached at, on every service certificate "
                           "(repeatable; 127.0.0.1, ::1 and localhost always)")  # fmt: skip
    init.add_argument("--days", type=int, default=DEFAULT_DAYS, help=f"validity in days (default {DEFAULT_DAYS})")
    init.add_argument("--force", action="store_true", help="replace the files of an existing CA in DIR")
    init.set_defaults(func=run_init)
    issue = sub.add_parser("issue", help="(re)issue one certificate NAME.pem / NAME.key signed by DIR's CA")
    issue.add_argument("dir", metavar="DIR", help="a directory `certs init` made (holds ca.pem and ca.key)")
    issue.add_argument("name", metavar="NAME", help="file name and common name, e.g. worker-3 or gateway")
    issue.add_argument("--host", action="append", default=[], help="as for init (repeatable)")
    issue.add_argument("--client-only", action="store_true", help="a client certificate (no server use, no names)")
    issue.add_argument("--days", type=int, default=DEFAULT_DAYS, help=f"validity in days (default {DEFAULT_DAYS})")
    issue.set_defaults(func=run_issue)


@dataclass(frozen=True)
class Authority:
    """A CA's certificate and key (cryptography objects)."""

    cert: Any
    key: Any

    @classmethod
    def load(cls, directory: Path) -> Authority:
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization

        try:
            cert = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
            key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), password=None)
        except (OSError, ValueError) as e:
            raise UsageError(f"DIR: {directory} holds no CA made by `shardmesh certs init` ({e})") from None
        return cls(cert, key)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _new_key() -> Any:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str) -> Any:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "shardmesh"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])  # fmt: skip


def new_authority(days: int = DEFAULT_DAYS, common_name: str = "shardmesh development CA") -> Authority:
    """A self-signed CA that may sign end-entity certificates only (path length 0)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    key = _new_key()
    name = _name(common_name)
    now = _now()
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    return Authority(cert, key)


def _alt_name(host: str) -> Any:
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return x509.DNSName(host)


def issue(ca: Authority, common_name: str, hosts: Sequence[str] = (), *, server: bool = True,
          days: int = DEFAULT_DAYS) -> tuple[Any, Any]:  # fmt: skip
    """(certificate, key) for `common_name`, signed by `ca`: a server-and-client certificate naming `hosts` (plus
    the loopback names), or with `server=False` a client certificate."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID

    key = _new_key()
    now = _now()
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH] if server else [
        ExtendedKeyUsageOID.CLIENT_AUTH]  # fmt: skip
    builder = (
        x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(ca.cert.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, key_cert_sign=False,
                                     crl_sign=False, content_commitment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key()), critical=False)
    )  # fmt: skip
    if server:
        names = list(dict.fromkeys([*DEFAULT_HOSTS, *hosts]))
        builder = builder.add_extension(x509.SubjectAlternativeName([_alt_name(h) for h in names]), critical=False)
    return builder.sign(ca.key, hashes.SHA256()), key


def _pem_cert(cert: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def _pem_key(key: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())  # fmt: skip


def _write(path: Path, data: bytes, private: bool) -> None:
    """Replace `path` at once (a reader sees the old file or the new one, never half of one); keys 0600."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_pair(directory: Path, name: str, cert: Any, key: Any) -> tuple[Path, Path]:
    """NAME.pem and NAME.key in `directory`; the key first, so a reader of a changed certificate finds its key."""
    key_path, cert_path = directory / f"{name}.key", directory / f"{name}.pem"
    _write(key_path, _pem_key(key), private=True)
    _write(cert_path, _pem_cert(cert), private=False)
    return cert_path, key_path


def init(directory: Path, hosts: Sequence[str] = (), days: int = DEFAULT_DAYS, force: bool = False) -> list[Path]:
    """Write a new CA and every service's and the client's certificate into `directory`; the paths written."""
    if days < 1:
        raise UsageError(f"--days: must be >= 1, got {days}")
    if (directory / "ca.pem").exists() and not force:
        raise UsageError(f"DIR: {directory} already holds a CA (ca.pem); --force replaces it and every certificate")
    directory.mkdir(parents=True, exist_ok=True)
    ca = new_authority(days)
    written = list(write_pair(directory, "ca", ca.cert, ca.key))
    for service in SERVICES:
        written += write_pair(directory, service, *issue(ca, service, hosts, days=days))
    written += write_pair(directory, CLIENT, *issue(ca, CLIENT, server=False, days=days))
    return written


def ensure(directory: Path, hosts: Sequence[str] = ()) -> bool:
    """`init` unless `directory` already holds what it makes (`up --tls` reuses it); whether it was made now."""
    names = ["ca.pem", *(f"{n}.{ext}" for n in (*SERVICES, CLIENT) for ext in ("pem", "key"))]
    if all((directory / n).is_file() for n in names):
        return False
    init(directory, hosts, force=True)
    return True


def run_init(args: argparse.Namespace) -> int:
    written = init(Path(args.dir), args.host, args.days, args.force)
    for path in written:
        print(path)
    print(f"a development CA and certificates for {', '.join(SERVICES)} and {CLIENT}; give each service "
          f"--tls-cert {args.dir}/SERVICE.pem --tls-key {args.dir}/SERVICE.key --tls-ca {args.dir}/ca.pem",
          file=sys.stderr)  # fmt: skip
    return 0


def run_issue(args: argparse.Namespace) -> int:
    if args.days < 1:
        raise UsageError(f"--days: must be >= 1, got {args.days}")
    if not args.name or "/" in args.name or args.name.startswith(".") or args.name == "ca":
        raise UsageError(f"NAME: a file name other than 'ca', got {args.name!r}")
    directory = Path(args.dir)
    ca = Authority.load(directory)
    cert, key = issue(ca, args.name, args.host, server=not args.client_only, days=args.days)
    for path in write_pair(directory, args.name, cert, key):
        print(path)
    return 0
