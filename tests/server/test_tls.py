"""HTTPS (``--ssl-certfile``, ``--ssl-keyfile``) and mutual TLS (``--ssl-ca-certs``) on a real server
process, with a certificate authority, a server and a client certificate made here; and the files checked
before the port is bound (exit 2 naming the flag)."""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from devtools.harness import ServerProcess, engine_launcher, start_clef_server

from clef_runtime.serve_command import add_serve_arguments, run_serve
from clef_runtime.server.settings import server_settings
from clef_runtime.server.tls import check_tls_files

FAKE_ENGINE = engine_launcher("devtools.fake_engine:FakeClef")
DECISION = {"state": "The parcel arrived broken.", "questions": {"refund": {"type": "noul"}}}


@dataclass(frozen=True)
class Issued:
    """A certificate and its key, as PEM files."""

    cert: Path
    key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _issue(
    directory: Path,
    stem: str,
    subject: str,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    *,
    authority: bool = False,
    server: bool = False,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey, Issued]:
    """A certificate for ``subject`` signed by ``issuer`` (itself when None), written to ``directory``."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    signer_cert, signer_key = issuer if issuer else (None, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(signer_cert.subject if signer_cert else _name(subject))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=authority, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(signer_key.public_key()), critical=False
        )
    )
    if authority:
        builder = builder.add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
    else:
        usage = x509.ExtendedKeyUsageOID.SERVER_AUTH if server else x509.ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if server:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(signer_key, hashes.SHA256())
    files = Issued(directory / f"{stem}.crt", directory / f"{stem}.key")
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert, key, files


@dataclass(frozen=True)
class Pki:
    """A certificate authority, a server certificate for 127.0.0.1 and a client certificate it issued, and
    a second authority that issued nothing here."""

    ca: Issued
    server: Issued
    client: Issued
    other_ca: Issued

    def trusting(self, ca: Issued | None = None, client: Issued | None = None) -> ssl.SSLContext:
        """A client context that trusts ``ca`` (default: this one), presenting ``client`` when given."""
        context = ssl.create_default_context(cafile=str((ca or self.ca).cert))
        if client is not None:
            context.load_cert_chain(str(client.cert), str(client.key))
        return context


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    ca_cert, ca_key, ca = _issue(directory, "ca", "clef test CA", None, authority=True)
    _, _, server = _issue(directory, "server", "localhost", (ca_cert, ca_key), server=True)
    _, _, client = _issue(directory, "client", "a client", (ca_cert, ca_key))
    _, _, other = _issue(directory, "other-ca", "another CA", None, authority=True)
    return Pki(ca, server, client, other)


@pytest.fixture(scope="module")
def https_server(pki: Pki) -> Iterator[ServerProcess]:
    server = start_clef_server(
        "fake",
        launcher=FAKE_ENGINE,
        timeout=60,
        tls=pki.trusting(),
        ssl_certfile=str(pki.server.cert),
        ssl_keyfile=str(pki.server.key),
    )
    yield server
    assert server.stop() == 0


@pytest.mark.slow
def test_https_answers_a_client_that_trusts_the_certificate(pki: Pki, https_server: ServerProcess) -> None:
    assert https_server.url.startswith("https://")
    with httpx.Client(base_url=https_server.url, verify=pki.trusting(), timeout=30) as client:
        answer = client.post("/v1/systemone", json=DECISION)
        assert answer.status_code == 200, answer.text
        assert answer.json()["answers"]["refund"]["type"] == "noul"
        assert client.get("/ready").status_code == 200


@pytest.mark.slow
def test_https_refuses_plain_http_and_an_untrusted_certificate(pki: Pki, https_server: ServerProcess) -> None:
    plain = https_server.url.replace("https://", "http://")
    with pytest.raises(httpx.TransportError):  # a TLS listener: no HTTP answer to plain text
        httpx.get(plain + "/health", timeout=10)
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(https_server.url + "/health", verify=pki.trusting(pki.other_ca), timeout=10)


@pytest.mark.slow
def test_mutual_tls_answers_only_a_client_certificate_from_the_named_authority(pki: Pki) -> None:
    server = start_clef_server(
        "fake",
        launcher=FAKE_ENGINE,
        timeout=60,
        tls=pki.trusting(client=pki.client),
        ssl_certfile=str(pki.server.cert),
        ssl_keyfile=str(pki.server.key),
        ssl_ca_certs=str(pki.ca.cert),
    )
    try:
        with_cert = httpx.post(
            server.url + "/v1/systemone", json=DECISION, verify=pki.trusting(client=pki.client), timeout=30
        )
        assert with_cert.status_code == 200, with_cert.text
        # Without a certificate (TLS 1.3 reports the refusal after the handshake, on the first read).
        with pytest.raises(httpx.TransportError):
            httpx.get(server.url + "/health", verify=pki.trusting(), timeout=10)
    finally:
        assert server.stop() == 0


# ------------------------------------------------------------------------------- files checked first


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    status = run_serve(parser.parse_args(["--model", "tiny", "--port", "0", *argv]), {})
    return status, capsys.readouterr().err


def test_a_missing_certificate_or_key_is_exit_2_naming_the_flag(
    pki: Pki, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = str(tmp_path / "nowhere.pem")
    status, err = _run(["--ssl-certfile", missing], capsys)
    assert status == 2 and f"--ssl-certfile {missing}: no such file" in err
    status, err = _run(["--ssl-certfile", str(pki.server.cert), "--ssl-keyfile", missing], capsys)
    assert status == 2 and f"--ssl-keyfile {missing}: no such file" in err
    status, err = _run(["--ssl-certfile", str(pki.server.cert), "--ssl-ca-certs", missing], capsys)
    assert status == 2 and f"--ssl-ca-certs {missing}: no such file" in err


def test_a_key_of_another_certificate_or_an_encrypted_key_is_exit_2(
    pki: Pki, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, err = _run(["--ssl-certfile", str(pki.server.cert), "--ssl-keyfile", str(pki.client.key)], capsys)
    assert status == 2 and "--ssl-certfile" in err and "private key" in err and "Traceback" not in err
    key = serialization.load_pem_private_key(pki.server.key.read_bytes(), None)
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    status, err = _run(["--ssl-certfile", str(pki.server.cert), "--ssl-keyfile", str(encrypted)], capsys)
    assert status == 2 and "unencrypted private key" in err
    # Negative control: the matching pair, and the authority, pass the same check.
    check_tls_files(
        server_settings(
            "tiny",
            ssl_certfile=str(pki.server.cert),
            ssl_keyfile=str(pki.server.key),
            ssl_ca_certs=str(pki.ca.cert),
        )
    )


def test_tls_with_ray_is_refused(pki: Pki, capsys: pytest.CaptureFixture[str]) -> None:
    status, err = _run(["--ssl-certfile", str(pki.server.cert), "--ray"], capsys)
    assert status == 2 and "--ssl-certfile is not served with --ray" in err


def test_a_key_or_client_authorities_without_a_certificate_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, err = _run(["--ssl-keyfile", "server.key"], capsys)
    assert status == 2 and "--ssl-keyfile needs --ssl-certfile" in err
    status, err = _run(["--ssl-ca-certs", "ca.pem"], capsys)
    assert status == 2 and "--ssl-ca-certs (client certificates) needs --ssl-certfile" in err
