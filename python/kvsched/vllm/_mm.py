"""vLLM's multimodal features as kvsched encoder inputs.

vLLM names an encoder output by its ``identifier`` (a string: a content hash, or a client-given UUID); the core
keys its encoder cache and the multimodal part of its block hashes by a 64-bit content hash. Each identifier is
mapped to the first 8 bytes of its BLAKE2b digest, so equal identifiers always share an entry (and prefix-cache
blocks) and distinct ones share it only on a 64-bit collision, which the map detects among the identifiers it
holds and refuses. The reverse map turns the core's evicted hashes back into vLLM's ``free_encoder_mm_hashes``:
an identifier stays in it while a request holds it or until the core reports its entry evicted.
"""

from __future__ import annotations

import hashlib
from typing import Any

from ._errors import UnsupportedFeatureError

__all__ = ["EncoderInputMap"]


def _hash64(identifier: str) -> int:
    return int.from_bytes(hashlib.blake2b(identifier.encode(), digest_size=8).digest(), "little")


class EncoderInputMap:
    """Identifier <-> 64-bit hash for the multimodal features of the requests the adapter holds."""

    def __init__(self) -> None:
        self._identifier: dict[int, str] = {}  # hash -> identifier
        self._holders: dict[int, int] = {}  # hash -> number of live requests with a feature of that identifier
        self._request_hashes: dict[str, tuple[int, ...]] = {}  # req_id -> its distinct hashes

    def __len__(self) -> int:
        return len(self._identifier)

    def encoder_inputs(self, request: Any) -> list[tuple[int, int, int]]:
        """The request's ``mm_features`` as the core's ``(start, num_tokens, hash)`` encoder inputs (vLLM sorts
        them by position). Raises :class:`UnsupportedFeatureError` for a feature kvsched cannot schedule."""
        inputs: list[tuple[int, int, int]] = []
        for feature in request.mm_features:
            pos = feature.mm_position
            identifier = feature.identifier
            if identifier is None:
                raise UnsupportedFeatureError(
                    f"request {request.request_id!r}: a multimodal feature without an identifier"
                )
            if pos.get_num_embeds() != pos.length:
                # vLLM then charges the encoder budget and cache by embeddings, not placeholder tokens.
                raise UnsupportedFeatureError(
                    f"request {request.request_id!r}: kvsched.vllm.Scheduler does not support multimodal "
                    "placeholders with embedding masks (is_embed) yet"
                )
            h = _hash64(identifier)
            known = self._identifier.get(h)
            if known is not None and known != identifier:
                raise UnsupportedFeatureError(
                    f"request {request.request_id!r}: the multimodal identifiers {identifier!r} and {known!r} "
                    "collide in kvsched's 64-bit encoder hash"
                )
            inputs.append((int(pos.offset), int(pos.length), h))
        distinct = tuple(dict.fromkeys(h for _, _, h in inputs))
        for i, (_, _, h) in enumerate(inputs):
            self._identifier[h] = request.mm_features[i].identifier
        for h in distinct:
            self._holders[h] = self._holders.get(h, 0) + 1
        self._request_hashes[request.request_id] = distinct
        return inputs

    def identifier(self, h: int) -> str:
        """vLLM's identifier of a hash the map holds (a live request's input, or an entry still cached)."""
        return self._identifier[h]

    def release(self, req_id: str) -> None:
        """The request left the scheduler: its identifiers stay mapped only while cached or held by another."""
        for h in self._request_hashes.pop(req_id, ()):
            n = self._holders[h] - 1
            if n:
                self._holders[h] = n
            else:
                del self._holders[h]

    def freed(self, hashes: list[int]) -> list[str]:
        """vLLM's ``free_encoder_mm_hashes`` for the core's evicted hashes; an identifier no request holds any
        more leaves the map."""
        out = [self._identifier[h] for h in hashes]
        for h in hashes:
            if h not in self._holders:
                self._identifier.pop(h, None)
        return out
