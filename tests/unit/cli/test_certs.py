"""`shardmesh certs init` and `certs issue`: what they write, what the certificates say (names, uses, issuer), that
keys are private, and the refusals (an existing CA, a bad name)."""

from __future__ import annotations

import ipaddress
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from shardmesh_cli.main import main

SERVICE_NAMES = ["coordinator", "gateway", "worker"]


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def names(cert: x509.Certificate) -> set[str]:
    """The subject alternative names: DNS names as given, IP addresses (which must be IP entries) as text."""
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    ips = san.get_values_for_type(x509.IPAddress)
    assert all(isinstance(ip, (ipaddress.IPv4Address, ipaddress.IPv6Address)) for ip in ips)
    return set(san.get_values_for_type(x509.DNSName)) | {str(ip) for ip in ips}


def uses(cert: x509.Certificate) -> set[x509.ObjectIdentifier]:
    return set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def test_init_makes_a_ca_and_a_certificate_per_service(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tls"
    assert main(["certs", "init", str(out), "--host", "coordinator.mesh", "--host", "10.0.0.7"]) == 0
    written = {Path(line).name for line in capsys.readouterr().out.split()}
    assert written == {"ca.pem", "ca.key"} | {f"{n}.{e}" for n in [*SERVICE_NAMES, "client"] for e in ("pem", "key")}
    ca = load(out / "ca.pem")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for name in SERVICE_NAMES:
        cert = load(out / f"{name}.pem")
        assert cert.issuer == ca.subject
        cert.verify_directly_issued_by(ca)
        assert names(cert) == {"127.0.0.1", "::1", "localhost", "coordinator.mesh", "10.0.0.7"}
        assert uses(cert) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    client = load(out / "client.pem")
    client.verify_directly_issued_by(ca)
    assert uses(client) == {ExtendedKeyUsageOID.CLIENT_AUTH}, "a client certificate cannot serve"
    for key in out.glob("*.key"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key


def test_init_refuses_to_replace_a_ca_unless_forced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["certs", "init", str(tmp_path)]) == 0
    first = (tmp_path / "ca.pem").read_bytes()
    assert main(["certs", "init", str(tmp_path)]) == 2
    assert "already holds a CA" in capsys.readouterr().err
    assert (tmp_path / "ca.pem").read_bytes() == first
    assert main(["certs", "init", str(tmp_path), "--force"]) == 0
    assert (tmp_path / "ca.pem").read_bytes() != first


def test_issue_signs_one_more_with_the_same_ca(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["certs", "init", str(tmp_path)]) == 0
    old = (tmp_path / "worker.pem").read_bytes()
    assert main(["certs", "issue", str(tmp_path), "worker", "--host", "w7.mesh"]) == 0
    assert main(["certs", "issue", str(tmp_path), "ops", "--client-only"]) == 0
    ca = load(tmp_path / "ca.pem")
    worker = load(tmp_path / "worker.pem")
    assert (tmp_path / "worker.pem").read_bytes() != old and "w7.mesh" in names(worker)
    worker.verify_directly_issued_by(ca)
    assert uses(load(tmp_path / "ops.pem")) == {ExtendedKeyUsageOID.CLIENT_AUTH}
    capsys.readouterr()
    assert main(["certs", "issue", str(tmp_path), "ca"]) == 2
    assert "NAME: a file name other than 'ca'" in capsys.readouterr().err
    assert main(["certs", "issue", str(tmp_path / "nowhere"), "x"]) == 2
    assert "holds no CA" in capsys.readouterr().err
