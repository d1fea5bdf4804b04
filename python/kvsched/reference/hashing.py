"""Chained block hashes for prefix caching. Mirrors ``rust/kvsched-core/src/hashing.rs``.

``hash(i) = H(parent, tokens of block i, extra keys)`` where ``parent`` is ``hash(i - 1)``, or the scheduler's
seed hash for block 0. Extra keys: the LoRA name on every block, the cache salt on block 0 only, and the encoder
inputs a block overlaps; with ``hash_lookahead_tokens`` L > 0 also the L tokens after the block and the encoder inputs
they overlap (a block gets its hash once they exist). ``H`` is SHA-256, or a 16-byte BLAKE2b standing in for the
core's xxh3-128 (hash values differ from the core's; only hash equality is part of the contract). ``sha256_pickle``:
a block without extra keys hashes as vLLM's default block hash, ``sha256(pickle.dumps((parent, tuple(tokens), None),
protocol=5))``, with the seed (32 bytes, or 32 random ones) as block 0's parent; these values are the core's and
vLLM's exactly. With ``hash_block_size`` below the block size a block's hash chains over its units (each hashed as
above, the salt on the request's first unit only, the encoder inputs and look-ahead tokens per unit) and is its last
unit's hash.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Sequence
from typing import Any


class _BlockHasher:
    """The hash function, the seed hash (random unless ``prefix_hash_seed`` fixes it) and the block size."""

    def __init__(
        self, algo: str, seed: int | str | bytes | None, block_size: int, lookahead: int = 0, unit: int | None = None
    ) -> None:
        self.hash_fn = _blake2b_128 if algo == "xxh3_128" else hashlib.sha256
        self.pickled = algo == "sha256_pickle"
        if self.pickled:
            assert seed is None or isinstance(seed, bytes)  # the config checks: 32 bytes
            self.seed_hash = os.urandom(32) if seed is None else seed
        else:
            seed_bytes = os.urandom(32) if seed is None else _seed_bytes(seed)
            self.seed_hash = self.hash_fn(b"kvsched-seed\0" + seed_bytes).digest()
        self.block_size = block_size
        self.lookahead = lookahead
        # Tokens per hash unit (``hash_block_size``): a block's hash chains over its units.
        self.unit = block_size if unit is None else unit

    def hash_block(
        self,
        parent: bytes,
        tokens: list[int],
        lora: str | None,
        salt: str | None,
        mm: Sequence[tuple[int, int]] = (),
        after: Sequence[int] = (),
    ) -> bytes:
        """``H(parent, tokens, extra keys)``, unambiguously encoded (fixed-width tokens, tagged keys). ``mm``: the
        encoder inputs overlapping the block, as (hash, start relative to the block); ``after``: the look-ahead
        tokens after the block."""
        if self.pickled and lora is None and salt is None and not mm and not after:
            return hashlib.sha256(pickle.dumps((parent, tuple(tokens), None), protocol=5)).digest()
        data = [parent, len(tokens).to_bytes(4, "little")]
        data += [t.to_bytes(4, "little") for t in tokens]
        for key in (lora, salt):
            raw = None if key is None else key.encode()
            data.append(b"\0" if raw is None else b"\1" + len(raw).to_bytes(8, "little") + raw)
        for h, offset in mm:
            data.append(b"\2" + h.to_bytes(8, "little") + offset.to_bytes(8, "little", signed=True))
        if after:
            data.append(b"\3" + b"".join(t.to_bytes(4, "little") for t in after))
        return self.hash_fn(b"".join(data)).digest()

    def block_hashes_of(self, tokens: list[int], salt: str | None, lora: str | None, start: int = 0,
                        prev: list[bytes] | None = None,
                        encoder_inputs: Sequence[tuple[int, int, int]] = ()) -> list[bytes]:  # fmt: skip
        """Hashes of the full blocks of ``tokens`` from block ``start`` on, chained on ``prev``. A block that
        overlaps encoder inputs also hashes their content hashes and offsets (vLLM's multimodal extra keys), so
        equal placeholder tokens with different encoder content never share KV."""
        hashes = list(prev or [])
        bs, la, unit = self.block_size, self.lookahead, self.unit
        for i in range(start, max(0, len(tokens) - la) // bs):
            parent = hashes[i - 1] if i else self.seed_hash
            # A block of several hash units: each unit chains on the one before; the block's hash is its last.
            for lo in range(i * bs, (i + 1) * bs, unit):
                # (the encoder inputs of the look-ahead tokens too: vLLM's look-ahead extra keys)
                mm = [(h, st - lo) for st, n, h in encoder_inputs if st < lo + unit + la and st + n > lo]
                after = tokens[lo + unit : lo + unit + la]
                parent = self.hash_block(parent, tokens[lo : lo + unit], lora, salt if lo == 0 else None, mm, after)
            hashes.append(parent)
        return hashes

    def unit_hashes_of(self, tokens: list[int], salt: str | None, lora: str | None, prev: list[bytes],
                       encoder_inputs: Sequence[tuple[int, int, int]] = ()) -> list[bytes]:  # fmt: skip
        """Hashes of every full hash unit of ``tokens`` (the units of a block not full yet too), chained on ``prev``
        (the units hashed so far); a block's hash (``block_hashes_of``) is its last unit's."""
        hashes = list(prev)
        la, unit = self.lookahead, self.unit
        for j in range(len(prev), max(0, len(tokens) - la) // unit):
            lo = j * unit
            mm = [(h, st - lo) for st, n, h in encoder_inputs if st < lo + unit + la and st + n > lo]
            after = tokens[lo + unit : lo + unit + la]
            parent = hashes[j - 1] if j else self.seed_hash
            hashes.append(self.hash_block(parent, tokens[lo : lo + unit], lora, salt if lo == 0 else None, mm, after))
        return hashes


def _blake2b_128(data: bytes) -> Any:
    """Stand-in for xxh3-128 (not in the stdlib): a 16-byte BLAKE2b digest."""
    return hashlib.blake2b(data, digest_size=16)


def _seed_bytes(seed: int | str | bytes) -> bytes:
    """Type-tagged bytes of a fixed ``prefix_hash_seed``."""
    if isinstance(seed, bytes):
        return b"b" + seed
    if isinstance(seed, str):
        return b"s" + seed.encode()
    return b"i" + str(seed).encode()
