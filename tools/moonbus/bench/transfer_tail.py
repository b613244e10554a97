"""The handoff's tail for `moonbus bench transfer`: the last layer's slice and the completion notice.

The streamed handoff (services/prefill/handoff.py -> services/messenger/handoff.py) writes each
layer's KV slice while the next layer computes, so what decode waits for after the prefill's last
layer is only

    tail = write(last layer's slice) + call("complete")     (the KV is whole at the decode node)

Measured through the service's own code: the receiving process runs the messenger's
`Reservations` (a /dev/shm file mapped and registered, coverage, the rename on completion), the
bench's process the prefill's `StreamSink`. Layers 0..L-2 are written first and drained by a call
(in the service they land while the last layer computes); then the tail is timed. Next to it, the
compute time of one decoder layer at that prompt length, the time the tail should hide behind.
"""

from __future__ import annotations

import mmap
import shutil
import statistics
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

import xxhash

from common.kv.blocks import KvLayout
from tools.moonbus.bench.transfer_peers import HOST, Peer, PeerFailed, answer_error

_BENCH_NODE = "bench-decode"


class HandoffPeer(Peer):
    """A decode node's messenger (its `Reservations`) in its own process."""

    name = "handoff_tail"

    @staticmethod
    def serve(conn: Connection, max_tokens: int, _seed: int, layout: KvLayout, secret: bytes) -> None:
        from common.transport import Transports
        from schemas.transfer import AcceptKv
        from services.messenger.handoff import Reservations

        shm_dir = Path(tempfile.mkdtemp(prefix="moonbus-bench-tail-", dir="/dev/shm"))
        try:
            transports = Transports("tcp", secret)
            transports.listen(HOST)
            transports.handle("ping", lambda body, peer: b"")
            reservations = Reservations(_BENCH_NODE, shm_dir, layout, max_tokens, transports, idle_s=600.0)
        except Exception as exc:
            answer_error(conn, exc)
            shutil.rmtree(shm_dir, ignore_errors=True)
            return
        conn.send(("ok", None))
        try:
            while True:
                op, arg = conn.recv()
                if op == "stop":
                    return
                try:
                    if op == "accept":
                        conn.send(("ok", reservations.accept(AcceptKv.from_bytes(arg)).to_bytes()))
                    elif op == "landed":  # checksum of the landed file, then remove it
                        path = shm_dir / arg
                        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                            digest = xxhash.xxh3_64_intdigest(m)
                        path.unlink()
                        conn.send(("ok", digest))
                    else:
                        raise ValueError(f"unknown op {op!r}")
                except Exception as exc:
                    answer_error(conn, exc)
        finally:
            transports.close()
            shutil.rmtree(shm_dir, ignore_errors=True)


def measure_tail(layout: KvLayout, tokens: list[int], repeats: int, secret: bytes) -> list[dict]:
    """One row per prompt length: the median tail, the slice's bytes, and whether the KV landed intact.

    `write_s` is the part of the tail until the last slice's write returned (its bytes handed to the
    kernel); the rest is the completion call: the slice received and verified, the coverage
    checked, the region unregistered and unmapped, the file renamed."""
    from common.transport import Transports

    peer = HandoffPeer(max(tokens), 0, layout, secret)  # its region is the messenger's: no seeded buffer
    transports = Transports("tcp", secret)
    rows = []
    try:
        for n in tokens:
            kv = _random_kv(layout, n)
            expected = xxhash.xxh3_64_intdigest(memoryview(kv.numpy()).cast("B"))
            # the first attempt warms up (connection, page faults)
            runs = [_one_handoff(peer, transports, layout, kv, expected, attempt) for attempt in range(repeats + 1)]
            rows.append({"pattern": f"tail:{n}", "case": "handoff_tail", "prompt_tokens": n,
                         "bytes": n * layout.bytes_per_token // layout.num_layers,
                         "seconds": statistics.median(tail for tail, _, _ in runs[1:]),
                         "write_s": statistics.median(write for _, write, _ in runs[1:]),
                         "intact": all(intact for _, _, intact in runs)})
    finally:
        transports.close()
        peer.close()
    return rows


def _random_kv(layout: KvLayout, tokens: int):
    """A request's KV [L, 2, H, T, D] of random bytes in elements of the layout's size (2: int16 stands in
    for bfloat16, which numpy cannot view; the transport moves bytes, whatever they mean)."""
    import torch

    shape = layout.request_shape(tokens)
    generator = torch.Generator().manual_seed(tokens)
    if layout.itemsize == 4:
        return torch.randn(shape, generator=generator)
    return torch.randint(-(1 << 15), 1 << 15, shape, generator=generator, dtype=torch.int16)


def _one_handoff(peer: HandoffPeer, transports, layout: KvLayout, kv, expected: int,
                 attempt: int) -> tuple[float, float, bool]:
    """Hand `kv` [L, 2, H, n, D] off to the peer as the prefill does; (tail s, its write s, whether the
    landed file's checksum is `expected`). The landed file is removed."""
    from common.kv.slices import SliceGeometry
    from schemas.transfer import AcceptKv, CompleteKv, CompleteKvReply, RegionRef
    from services.prefill.handoff import StreamSink

    n, last = kv.shape[3], layout.num_layers - 1
    request = AcceptKv(f"bench-{n}", attempt, n, "bench-prefill:1", _BENCH_NODE)
    ref = RegionRef.from_bytes(peer.ask(("accept", request.to_bytes())))
    with transports.connect(ref.endpoints) as channel:
        sink = StreamSink(channel, ref, SliceGeometry(kv.shape, layout.itemsize))
        for layer in range(last):
            sink.write_layer(layer, 0, kv[layer])
        channel.call("ping")  # the earlier layers have landed, as they have during the last layer's compute
        started = time.perf_counter()
        sink.write_layer(last, 0, kv[last])
        written = time.perf_counter()
        reply = CompleteKvReply.from_bytes(channel.call("complete", CompleteKv(ref.region).to_bytes()))
        done = time.perf_counter()
    if not reply.ok or reply.dest is None:
        raise PeerFailed(f"handoff_tail: the completion was refused: {reply.error}")
    return done - started, written - started, peer.ask(("landed", reply.dest.name)) == expected


def layer_compute_seconds(model, tokens: int, repeats: int) -> float:
    """Median time of one decoder layer (the last) over a `tokens`-token prompt, as the prefill runs
    it (the model's dtype, sdpa with is_causal, torch.inference_mode, the process's torch threads)."""
    import torch

    inner = model.model
    layer = inner.layers[-1]
    with torch.inference_mode():
        generator = torch.Generator().manual_seed(tokens)
        hidden = torch.randn(1, tokens, model.config.hidden_size, generator=generator).to(model.dtype)
        positions = torch.arange(tokens)[None, :]
        rope = inner.rotary_emb(hidden, position_ids=positions)
        times = []
        for i in range(repeats + 1):  # the first one warms up
            started = time.perf_counter()
            layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=rope)
            if i:
                times.append(time.perf_counter() - started)
    return statistics.median(times)
