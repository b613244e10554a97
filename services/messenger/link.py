"""The point-to-point KV link between messengers (TCP).

A connection carries one exchange, opened by a 1-byte op:
  b"T" transfer: [frame TransferHeader][nbytes payload]      -> [frame TransferAck]
  b"F" fetch:    [frame FetchBlocks]                         -> [frame FetchReply][n * nbytes payloads]
A frame is [4-byte big-endian length][JSON].
"""

from __future__ import annotations

import asyncio
import struct

from schemas.codec import Wire

_LEN = struct.Struct(">I")
MAX_HEADER = 16 << 20
OP_TRANSFER = b"T"
OP_FETCH = b"F"


class LinkError(ConnectionError):
    """Raised when the peer closes the link or sends a frame that breaks the protocol."""


async def write_frame(writer: asyncio.StreamWriter, header: Wire, payload: bytes | memoryview = b"", op: bytes = b"") -> None:
    body = header.to_bytes()
    writer.write(op + _LEN.pack(len(body)) + body)
    if payload:
        writer.write(payload)
    await writer.drain()


async def read_op(reader: asyncio.StreamReader) -> bytes:
    try:
        return await reader.readexactly(1)
    except asyncio.IncompleteReadError as exc:
        raise LinkError("peer closed the link") from exc


async def read_header(reader: asyncio.StreamReader, cls: type[Wire]) -> Wire:
    try:
        (size,) = _LEN.unpack(await reader.readexactly(_LEN.size))
        if size > MAX_HEADER:
            raise LinkError(f"header of {size} bytes is larger than {MAX_HEADER}")
        return cls.from_bytes(await reader.readexactly(size))
    except asyncio.IncompleteReadError as exc:
        raise LinkError("peer closed the link") from exc


async def read_payload(reader: asyncio.StreamReader, nbytes: int) -> bytes:
    try:
        return await reader.readexactly(nbytes)
    except asyncio.IncompleteReadError as exc:
        raise LinkError(f"peer closed the link after {len(exc.partial)} of {nbytes} bytes") from exc
