"""KV blocks: chained block keys, the payload layout, checksums, cutting and joining.

Keys. A prompt is cut into full blocks of `block_tokens` tokens; a trailing partial block gets no
key (only full blocks are shared). Block i's key chains on block i-1's key:

    key[-1] = 0
    key[i]  = xxh3_64(seed, prev=key[i-1] as 8 bytes LE || tokens[i*bt:(i+1)*bt] as int32 LE)

so equal keys mean equal prefixes (up to 64-bit collisions) and a prefix match is "how many
leading keys are equal". Never Python's `hash()`: it is randomised per process.

Traces carry no tokens, only one hash id per 512-token block; `block_keys_from_hash_ids` chains
the ids the same way (with its own domain tag), so equal id chains give equal key chains.

Payload layout. One block is ONE contiguous C-order array

    [num_layers, 2 (K then V), num_kv_heads, block_tokens, head_dim]   in `KvLayout.dtype`

and a whole request's KV is the same shape with seq_len in place of block_tokens, so blocks are
cut and joined along axis 3. The payload's checksum is xxh3_64 of its bytes.

torch is imported lazily: key hashing and the cache simulator must not pay for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import xxhash

if TYPE_CHECKING:
    import torch

DEFAULT_SEED = 0x6D6F6F6E62757300  # b"moonbus\0"
_TRACE_TAG = b"trace-id"  # domain tag: a trace-id chain never equals a token chain

# dtype name -> (bytes per element, numpy dtype name or None when numpy has none)
DTYPES: dict[str, tuple[int, str | None]] = {
    "float32": (4, "float32"),
    "float16": (2, "float16"),
    "bfloat16": (2, None),
}


class ChecksumMismatch(Exception):
    """Raised when a payload's bytes do not hash to the checksum stored or sent with them.

    Raised by `verify` and `unpack_block(expected_checksum=...)`, and by the SSD store's `get`
    when an LMDB record is corrupt. The block must then be treated as a miss (and dropped).
    """

    def __init__(self, expected: int, actual: int, key: int | None = None) -> None:
        where = f" for block {key:#018x}" if key is not None else ""
        super().__init__(f"checksum mismatch{where}: expected {expected:#018x}, got {actual:#018x}")
        self.expected = expected
        self.actual = actual
        self.key = key


class LayoutMismatch(ValueError):
    """Raised when a tensor or buffer does not have the shape, dtype or size of the `KvLayout`."""


# ---------------------------------------------------------------------------------------------
# Keys


def block_keys(token_ids: Sequence[int], block_tokens: int, seed: int = DEFAULT_SEED) -> list[int]:
    """Chained keys (unsigned 64-bit) of the full blocks of `token_ids`; a partial tail has none."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    num_blocks = len(token_ids) // block_tokens
    if num_blocks == 0:
        return []
    # One conversion for the whole prompt; raises OverflowError if a token id exceeds int32.
    tokens = np.asarray(token_ids[: num_blocks * block_tokens], dtype="<i4").tobytes()
    stride = block_tokens * 4
    keys: list[int] = []
    prev = 0
    for i in range(num_blocks):
        data = prev.to_bytes(8, "little") + tokens[i * stride : (i + 1) * stride]
        prev = xxhash.xxh3_64_intdigest(data, seed=seed)
        keys.append(prev)
    return keys


def namespace_seed(namespace: str) -> int:
    """The block-key seed of a cache namespace ("" = the common one): different namespaces never
    share a key, so their requests never share a block (tenant isolation)."""
    if not namespace:
        return DEFAULT_SEED
    return xxhash.xxh3_64_intdigest(b"namespace|" + namespace.encode(), seed=DEFAULT_SEED)


def block_keys_from_hash_ids(hash_ids: Sequence[int], seed: int = DEFAULT_SEED) -> list[int]:
    """Chained keys over a trace's per-block hash ids: equal id prefixes give equal key prefixes."""
    keys: list[int] = []
    prev = 0
    for hash_id in hash_ids:
        data = _TRACE_TAG + prev.to_bytes(8, "little") + int(hash_id).to_bytes(8, "little", signed=True)
        prev = xxhash.xxh3_64_intdigest(data, seed=seed)
        keys.append(prev)
    return keys


# ---------------------------------------------------------------------------------------------
# Layout


@dataclass(frozen=True)
class KvLayout:
    """Shape of one KV block: [num_layers, 2 (K, V), num_kv_heads, block_tokens, head_dim], C order."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KvLayout.{name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"KvLayout.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][0]

    @property
    def bytes_per_token(self) -> int:
        """K and V of every layer for one token."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def block_nbytes(self) -> int:
        return self.bytes_per_token * self.block_tokens

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.num_kv_heads, self.block_tokens, self.head_dim)

    @property
    def signature(self) -> str:
        """What two instances must agree on to exchange KV: "layers x 2 x kv heads x head dim dtype"."""
        return f"{self.num_layers}x2x{self.num_kv_heads}x{self.head_dim} {self.dtype}"

    def request_shape(self, seq_len: int) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.num_kv_heads, seq_len, self.head_dim)


# ---------------------------------------------------------------------------------------------
# Payloads


def checksum(buf: bytes | bytearray | memoryview) -> int:
    """xxh3_64 of a payload's bytes, as an unsigned 64-bit int."""
    return xxhash.xxh3_64_intdigest(buf)


def verify(buf: bytes | bytearray | memoryview, expected: int, key: int | None = None) -> None:
    """Raise `ChecksumMismatch` unless `checksum(buf) == expected`."""
    actual = checksum(buf)
    if actual != expected:
        raise ChecksumMismatch(expected, actual, key)


def pack_block(block: Any, layout: KvLayout | None = None) -> bytes:
    """The bytes of one block (a torch tensor or numpy array), checked against `layout` if given."""
    if _is_torch(block):
        if layout is not None:
            _check_torch(block, layout, layout.block_shape)
        flat = block.detach().cpu().contiguous().reshape(-1)
        # numpy has no bfloat16: move the raw 16-bit words instead.
        if flat.element_size() == 2:
            import torch

            flat = flat.view(torch.int16)
        return flat.numpy().tobytes()
    array = np.asarray(block)
    if layout is not None:
        if layout.dtype == "bfloat16":
            raise LayoutMismatch("a bfloat16 block must be packed from a torch tensor")
        if array.shape != layout.block_shape or array.dtype != np.dtype(layout.dtype):
            raise LayoutMismatch(
                f"block is {array.dtype}{list(array.shape)}, layout wants {layout.dtype}{list(layout.block_shape)}"
            )
    return np.ascontiguousarray(array).tobytes()


def unpack_block(
    buf: bytes | bytearray | memoryview,
    layout: KvLayout,
    *,
    as_torch: bool = False,
    expected_checksum: int | None = None,
) -> Any:
    """One block's bytes as an array shaped `layout.block_shape` (numpy, or torch if `as_torch`).

    Zero copy: the result views `buf` (read-only if `buf` is bytes; torch then warns, so pass a
    bytearray or writable memoryview for a writable tensor). bfloat16 needs `as_torch=True`.
    Raises `LayoutMismatch` on a wrong size and `ChecksumMismatch` if `expected_checksum` fails.
    """
    if len(memoryview(buf).cast("B")) != layout.block_nbytes:
        raise LayoutMismatch(f"payload is {len(memoryview(buf).cast('B'))} bytes, layout wants {layout.block_nbytes}")
    if expected_checksum is not None:
        verify(buf, expected_checksum)
    if as_torch:
        import torch

        dtype = getattr(torch, layout.dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(layout.block_shape)
    np_dtype = DTYPES[layout.dtype][1]
    if np_dtype is None:
        raise LayoutMismatch(f"numpy has no {layout.dtype}: use as_torch=True")
    return np.frombuffer(buf, dtype=np_dtype).reshape(layout.block_shape)


# ---------------------------------------------------------------------------------------------
# Cutting a request's KV into blocks and joining them back (torch)

SEQ_AXIS = 3


def split_blocks(kv: "torch.Tensor", layout: KvLayout) -> list["torch.Tensor"]:
    """Cut a request's KV [L, 2, H, seq_len, D] into its full blocks (contiguous copies).

    The trailing partial block, if any, is not returned: only full blocks are shared.
    """
    if kv.dim() != 5:
        raise LayoutMismatch(f"request KV must have 5 dims, got shape {list(kv.shape)}")
    _check_torch(kv, layout, layout.request_shape(kv.shape[SEQ_AXIS]))
    num_blocks = kv.shape[SEQ_AXIS] // layout.block_tokens
    return [
        kv.narrow(SEQ_AXIS, i * layout.block_tokens, layout.block_tokens).contiguous() for i in range(num_blocks)
    ]


def assemble_blocks(blocks: Sequence["torch.Tensor"]) -> "torch.Tensor":
    """Join blocks [L, 2, H, bt, D] back into one request KV [L, 2, H, n*bt, D] (a new tensor)."""
    if not blocks:
        raise ValueError("assemble_blocks needs at least one block")
    import torch

    return torch.cat(list(blocks), dim=SEQ_AXIS)


def _is_torch(value: Any) -> bool:
    return type(value).__module__.startswith("torch")


def dtype_name(tensor: "torch.Tensor") -> str:
    """A tensor's dtype as layouts and KV handles name it ("float32", "bfloat16")."""
    return str(tensor.dtype).removeprefix("torch.")


def _check_torch(tensor: "torch.Tensor", layout: KvLayout, shape: tuple[int, ...]) -> None:
    name = dtype_name(tensor)
    if tuple(tensor.shape) != shape or name != layout.dtype:
        raise LayoutMismatch(f"tensor is {name}{list(tensor.shape)}, layout wants {layout.dtype}{list(shape)}")
