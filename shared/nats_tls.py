"""A private certificate authority for one NATS deployment: the CA, the server's
certificate (for the hosts clients dial) and one client certificate per service, made
with `cryptography` (ECDSA P-256). Keys are written 0600; certificates are public.
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import msgspec
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from shared.nats_secrets import write_private

VALID_DAYS = 365


class CertPair(msgspec.Struct, frozen=True, kw_only=True):
    cert_file: str
    key_file: str


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Tandem"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(directory: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> CertPair:
    cert_file = directory / f"{stem}-cert.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file = write_private(directory / f"{stem}-key.pem", key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode())
    return CertPair(cert_file=str(cert_file), key_file=str(key_file))


class CertificateAuthority:
    """Create with `CertificateAuthority.create(directory)`; then `issue_server`/`issue_client`."""

    def __init__(self, directory: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey,
                 files: CertPair) -> None:
        self.directory = directory
        self.cert = cert
        self._key = key
        self.files = files

    @property
    def ca_file(self) -> str:
        return self.files.cert_file

    @classmethod
    def create(cls, directory: str | Path, name: str = "Tandem NATS CA") -> CertificateAuthority:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
                .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                             content_commitment=False, key_encipherment=False,
                                             data_encipherment=False, key_agreement=False,
                                             encipher_only=False, decipher_only=False), critical=True)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .sign(key, hashes.SHA256()))
        return cls(directory, cert, key, _write(directory, "ca", cert, key))

    def _issue(self, stem: str, common_name: str, usage: x509.ObjectIdentifier,
               hosts: tuple[str, ...] = ()) -> CertPair:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(self.cert.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                                  critical=False))
        if hosts:
            builder = builder.add_extension(x509.SubjectAlternativeName([_san(host) for host in hosts]),
                                            critical=False)
        return _write(self.directory, stem, builder.sign(self._key, hashes.SHA256()), key)

    def issue_server(self, hosts: tuple[str, ...] = ("127.0.0.1", "localhost", "::1")) -> CertPair:
        """The server's certificate, valid for every host name or address clients dial."""
        return self._issue("server", "nats-server", ExtendedKeyUsageOID.SERVER_AUTH, hosts)

    def issue_client(self, name: str) -> CertPair:
        return self._issue(f"client-{name}", name, ExtendedKeyUsageOID.CLIENT_AUTH)

    def forget_key(self) -> None:
        """Delete the CA's key file: no certificate can be issued under it any more."""
        Path(self.files.key_file).unlink(missing_ok=True)


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)
