"""The cluster's link CA and the certificates it issues, for TLS on the KV links (`--link-tls`).

    link-ca.pem          the CA's certificate: every process that opens KV links trusts it alone
    link-ca.key          its private key (0600): only the launcher (`moonbus up`, compose-secrets) reads it
    link-<name>.pem      a process's (or a compose service's) private key and certificate, 0600

Each is made once and kept, like the other secrets (a restarted process finds its own again);
delete the directory's link-* files to issue new ones. Keys are ECDSA P-256, certificates valid
for VALID_DAYS; a peer is checked by the CA that issued its certificate, not by host name
(common.security.link_tls).
"""

from __future__ import annotations

import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from common.security import write_private

VALID_DAYS = 825
CA_CERT, CA_KEY = "link-ca.pem", "link-ca.key"


def ca_file(directory: Path) -> Path:
    return directory / CA_CERT


def cert_file(directory: Path, name: str) -> Path:
    return directory / f"link-{name}.pem"


def ensure_cert(directory: Path, name: str) -> Path:
    """`name`'s key and certificate (made once, by the cluster's link CA, made once too)."""
    path = cert_file(directory, name)
    if path.exists():
        return path
    ca_key, ca_cert = _ensure_ca(directory)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _certificate(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]), key, ca_cert.subject, ca_key,
                        is_ca=False)
    write_private(path, _key_pem(key) + cert.public_bytes(serialization.Encoding.PEM))
    return path


def _ensure_ca(directory: Path):
    key_path, cert_path = directory / CA_KEY, ca_file(directory)
    if key_path.exists() and cert_path.exists():
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        return key, x509.load_pem_x509_certificate(cert_path.read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "moonbus link CA")])
    cert = _certificate(name, key, name, key, is_ca=True)
    write_private(key_path, _key_pem(key))
    write_private(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return key, cert


def _certificate(subject: x509.Name, key, issuer: x509.Name, issuer_key, is_ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
               .add_extension(x509.BasicConstraints(ca=is_ca, path_length=0 if is_ca else None), critical=True))
    if is_ca:
        builder = builder.add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False),
                                        critical=True)
    else:  # both ends of a link: it accepts and it connects
        builder = builder.add_extension(x509.ExtendedKeyUsage([x509.ExtendedKeyUsageOID.SERVER_AUTH,
                                                               x509.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
