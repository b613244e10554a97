"""Secrets and the small cryptography around them (stdlib hmac/hashlib/secrets only).

- The cluster secret: 32 random bytes, hex in a 0600 file, shared by every service of a cluster.
  It keys the point-to-point links' handshake (`link_proof`) and the audit chain.
- API keys: handed to users once, stored only as SHA-256 hashes (`hash_key`).
- TLS on the point-to-point links (`link_tls`, with `--link-cert` and `--link-ca`): both ends show
  a certificate issued by the cluster's link CA (`moonbus up --link-tls`, `moonbus compose-secrets`
  issue them: tools/moonbus/cluster/certs.py), and every byte is encrypted and authenticated
  (TLS 1.3's AEAD), so a relay on the path can neither read nor rewrite KV.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import secrets
import ssl
import stat
from dataclasses import dataclass
from pathlib import Path

LINK_NONCE_BYTES = 16


class SecretError(ValueError):
    """Raised when a secret file is missing, unreadable or not what it should be."""


def new_secret_file(path: Path, nbytes: int = 32) -> Path:
    """Write a new random secret (hex) readable by its owner only; returns the path."""
    return write_private(path, (secrets.token_hex(nbytes) + "\n").encode())


def write_private(path: Path, data: bytes) -> Path:
    """Write `data` to a file readable by its owner only (created so: never readable in between),
    never through a link planted at its path (`open_own`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = open_own(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    return path


class UnsafeFile(PermissionError):
    """A file the cluster would write or read as its own that is a link, not a plain file, or another user's."""


def open_own(path: str | os.PathLike, flags: int, mode: int = 0o600) -> int:
    """A descriptor of `path` opened without following a link at it (O_NOFOLLOW: a link planted
    there would send a write, or a read, to a file of the planter's choosing); refused (UnsafeFile,
    naming the path) where a link, something other than a plain file, or another user's file is
    there, and, with O_EXCL, where anything is. O_TRUNC is applied only once the file is known to
    be this user's; a FIFO cannot hold the open (O_NONBLOCK until checked). With O_CREAT (the
    cluster writes it as its own), a file already there with modes beyond `mode` (an older
    build's) is tightened to them."""
    path = os.fspath(path)
    try:
        fd = os.open(path, (flags & ~os.O_TRUNC) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFile(f"{path} is a link: the cluster opens its files only where they are, never through "
                             f"a link; remove it") from None
        if exc.errno == errno.EEXIST and flags & os.O_EXCL:
            raise UnsafeFile(f"{path} is already there (a link, or a file left behind): the cluster makes this "
                             f"file new; remove it") from None
        if exc.errno == errno.ENXIO:  # a FIFO without a reader, a socket
            raise UnsafeFile(f"{path} is not a plain file: remove it") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(f"{path} is not a plain file: remove it")
        if st.st_uid != os.getuid():
            raise UnsafeFile(f"{path} belongs to uid {st.st_uid}, not to this user ({os.getuid()}): another user "
                             f"put it there; remove it")
        os.set_blocking(fd, True)
        if flags & os.O_CREAT and stat.S_IMODE(st.st_mode) & ~mode:
            os.fchmod(fd, stat.S_IMODE(st.st_mode) & mode)  # a file kept from before with looser modes: tightened
        if flags & os.O_TRUNC:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def kept_file(path: Path) -> bool:
    """Whether a file the cluster made earlier and keeps (a secret) is there; refused (UnsafeFile)
    where a link, something other than a plain file, or another user's file stands in its place,
    since it would be read as the cluster's own."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFile(f"{path} is not a plain file (a link, or something else): the cluster reads it as its "
                         f"own; remove it")
    if st.st_uid != os.getuid():
        raise UnsafeFile(f"{path} belongs to uid {st.st_uid}, not to this user ({os.getuid()}): remove it")
    return True


class UnsafeDirectory(PermissionError):
    """A directory the cluster would keep its files in, that another user could read or swap."""


def private_dir(path: Path, kept: bool = False) -> Path:
    """`path` as a directory only this user can enter: made (with any missing parents) 0700 where
    missing, tightened to 0700 where it is this user's; refused (UnsafeDirectory, saying what is in
    the way) where it is a link or a file, belongs to another user, or sits in a folder another
    user could rename it out of (theirs, or writable by all without the sticky bit).

    `kept`: the cluster keeps files there and trusts them again (its home, its secrets, the SSD
    tier): one that others could write (group or all, sticky or not) is refused, not tightened,
    since whatever they left in it would stay."""
    path = Path(path)
    missing = []
    probe = path
    while not os.path.lexists(probe) and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:  # made meanwhile: checked below like any existing one
            pass
    uid = os.getuid()
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(f"{path} is not a directory (a link or a file is there): remove it, or choose another")
    if st.st_uid != uid:
        raise UnsafeDirectory(f"{path} belongs to uid {st.st_uid}, not to this user ({uid}): another user made it "
                              f"first; remove it, or choose another")
    if kept and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeDirectory(f"{path} may be written by other users (mode {stat.S_IMODE(st.st_mode):o}): what they "
                              f"left there would be kept as the cluster's; check what is in it and chmod 700 it, "
                              f"or choose another")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)
    for parent in path.parents:
        pst = os.stat(parent)
        if pst.st_uid not in (0, uid):
            raise UnsafeDirectory(f"{path} is inside {parent}, which belongs to uid {pst.st_uid}: its owner could "
                                  f"swap it; choose another place")
        if pst.st_mode & stat.S_IWOTH and not pst.st_mode & stat.S_ISVTX:
            raise UnsafeDirectory(f"{path} is inside {parent}, which anyone may write without the sticky bit: "
                                  f"anyone could swap it; choose another place")
    return path


def read_secret(path: str | Path) -> bytes | None:
    """The secret in a file written by `new_secret_file` (None for no file configured)."""
    if not path:
        return None
    try:
        text = Path(path).read_text().strip()
        secret = bytes.fromhex(text)
    except (OSError, ValueError) as exc:
        raise SecretError(f"cannot read the secret in {path}: {exc}") from exc
    if len(secret) < 16:
        raise SecretError(f"the secret in {path} is too short ({len(secret)} bytes)")
    return secret


def link_proof(secret: bytes, nonce: bytes, role: bytes) -> bytes:
    """What a peer answers to a nonce to prove it holds the cluster secret (role: b"client"/b"server",
    so that one side's answer cannot be replayed as the other's)."""
    return hmac.new(secret, role + b"|" + nonce, hashlib.sha256).digest()


def proofs_match(expected: bytes, got: bytes) -> bool:
    return hmac.compare_digest(expected, got)


def hash_key(key: str) -> str:
    """How an API key is stored: its SHA-256, hex (a key is 32 random bytes: no salt needed)."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_api_key() -> str:
    return "mb-" + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class LinkTls:
    """The TLS contexts of a process's KV links: it accepts (server) and connects (client) only with
    a certificate of the cluster's link CA at both ends. Peers are known by that CA, not by host
    name: a locator is an address, and any certificate the cluster issued is a member's."""

    server: ssl.SSLContext
    client: ssl.SSLContext


def link_tls(cert_file: str | Path, ca_file: str | Path) -> LinkTls | None:
    """The contexts for a certificate (its key in the same PEM file) and the link CA; None when no
    certificate is configured. Raises SecretError if either file cannot be loaded."""
    if not cert_file and not ca_file:
        return None
    if not cert_file or not ca_file:
        raise SecretError("TLS on the KV links needs both --link-cert and --link-ca")
    contexts = []
    for purpose in (ssl.PROTOCOL_TLS_SERVER, ssl.PROTOCOL_TLS_CLIENT):
        ctx = ssl.SSLContext(purpose)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.check_hostname = False  # before verify_mode: a client context checks names by default
        ctx.verify_mode = ssl.CERT_REQUIRED  # both ends: a certificate of the cluster's link CA
        try:
            ctx.load_cert_chain(cert_file)
            ctx.load_verify_locations(cafile=str(ca_file))
        except (OSError, ssl.SSLError) as exc:
            raise SecretError(f"cannot load the KV link's TLS files ({cert_file}, {ca_file}): {exc}") from exc
        contexts.append(ctx)
    return LinkTls(*contexts)
