"""The point-to-point KV link between messengers (TCP).

A connection first proves that both ends hold the cluster secret (when the cluster has one):

    server -> 16-byte nonce S
    client -> 16-byte nonce C, HMAC(secret, "client" | S)
    server -> HMAC(secret, "server" | C)              (each side checks the other's proof)

then carries one exchange, opened by a 1-byte op:
  b"T" transfer: [frame TransferHeader][nbytes payload]      -> [frame TransferAck]
  b"F" fetch:    [frame FetchBlocks]                         -> [frame FetchReply][n * nbytes payloads]
A frame is [4-byte big-endian length][JSON]. Every read has a deadline: a silent peer cannot hold
a connection (or the memory it was promised) open.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct

from common.security import LINK_NONCE_BYTES, link_proof, proofs_match
from schemas.codec import Wire

READ_TIMEOUT_S = 30.0
_PROOF_BYTES = 32

_LEN = struct.Struct(">I")
MAX_HEADER = 1 << 20  # a header is a little JSON: a bigger one is an attack or a bug
OP_TRANSFER = b"T"
OP_FETCH = b"F"


class LinkError(ConnectionError):
    """Raised when the peer closes the link or sends a frame that breaks the protocol."""


class LinkRefused(LinkError):
    """Raised when the peer does not prove that it holds the cluster secret."""


async def _read(reader: asyncio.StreamReader, n: int, timeout: float = READ_TIMEOUT_S) -> bytes:
    try:
        return await asyncio.wait_for(reader.readexactly(n), timeout)
    except asyncio.IncompleteReadError as exc:
        raise LinkError(f"peer closed the link after {len(exc.partial)} of {n} bytes") from exc
    except asyncio.TimeoutError as exc:
        raise LinkError(f"peer sent nothing for {timeout:g} s") from exc


async def server_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes | None) -> None:
    """The accepting side: challenge the peer, then prove ourselves (no secret: nothing to do)."""
    if secret is None:
        return
    nonce = os.urandom(LINK_NONCE_BYTES)
    writer.write(nonce)
    await writer.drain()
    answer = await _read(reader, LINK_NONCE_BYTES + _PROOF_BYTES, timeout=10.0)
    client_nonce, proof = answer[:LINK_NONCE_BYTES], answer[LINK_NONCE_BYTES:]
    if not proofs_match(link_proof(secret, nonce, b"client"), proof):
        raise LinkRefused("the peer does not hold the cluster secret")
    writer.write(link_proof(secret, client_nonce, b"server"))
    await writer.drain()


async def client_handshake(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes | None) -> None:
    if secret is None:
        return
    server_nonce = await _read(reader, LINK_NONCE_BYTES, timeout=10.0)
    nonce = os.urandom(LINK_NONCE_BYTES)
    writer.write(nonce + link_proof(secret, server_nonce, b"client"))
    await writer.drain()
    if not proofs_match(link_proof(secret, nonce, b"server"), await _read(reader, _PROOF_BYTES, timeout=10.0)):
        raise LinkRefused("the listener does not hold the cluster secret")


def client_handshake_blocking(sock: socket.socket, secret: bytes | None) -> None:
    """The same, on a blocking socket (the pipeline's sending thread)."""
    if secret is None:
        return

    def recv_exactly(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            part = sock.recv(n - len(buf))
            if not part:
                raise LinkError("the listener closed the link during the handshake")
            buf += part
        return buf

    server_nonce = recv_exactly(LINK_NONCE_BYTES)
    nonce = os.urandom(LINK_NONCE_BYTES)
    sock.sendall(nonce + link_proof(secret, server_nonce, b"client"))
    if not proofs_match(link_proof(secret, nonce, b"server"), recv_exactly(_PROOF_BYTES)):
        raise LinkRefused("the listener does not hold the cluster secret")


async def write_frame(writer: asyncio.StreamWriter, header: Wire, payload: bytes | memoryview = b"", op: bytes = b"") -> None:
    body = header.to_bytes()
    writer.write(op + _LEN.pack(len(body)) + body)
    if payload:
        writer.write(payload)
    await writer.drain()


async def read_op(reader: asyncio.StreamReader) -> bytes:
    return await _read(reader, 1)


async def read_header(reader: asyncio.StreamReader, cls: type[Wire]) -> Wire:
    (size,) = _LEN.unpack(await _read(reader, _LEN.size))
    if size > MAX_HEADER:
        raise LinkError(f"header of {size} bytes is larger than {MAX_HEADER}")
    return cls.from_bytes(await _read(reader, size))


async def read_payload(reader: asyncio.StreamReader, nbytes: int) -> bytes:
    return await _read(reader, nbytes)
