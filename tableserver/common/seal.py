"""Sealed tcp frames: AES-256-GCM over every payload of a data connection, keyed from the session.

When a data connection is sealed (the server's choice, announced in the HELLO answer: on by default
whenever the control plane runs TLS), each direction has its own key, derived from the session secret
and both handshake nonces (so keys differ on every connection and never cross the wire)::

    key(direction) = HMAC-SHA256(secret, "tableserver-seal-" + direction | server nonce | client nonce)

Every payload that follows the HELLO (GATHER ids, OK rows, error messages) is encrypted in place of
the plaintext and followed by its 16-byte GCM tag; the frame's 24-byte header stays readable (it
routes the frame) but is authenticated as associated data, and ``count`` keeps meaning ids, rows or
message bytes. Nonces are a per-direction frame counter (8 bytes, little-endian, after 4 zero bytes):
tcp is ordered, so both ends count alike and a replayed, reordered or dropped frame fails its tag.

Rows are encrypted chunk by chunk as they are sent and decrypted chunk by chunk as they arrive; a
receiver writes plaintext before the tag is checked, and a bad tag fails the request and the
connection, so no caller ever takes unauthenticated rows.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

TAG_BYTES = 16
C2S, S2C = b"c2s", b"s2c"


def _aead():
    try:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    except ImportError:  # pragma: no cover - a dependency of tableserver
        raise RuntimeError("sealed tcp connections need the cryptography package: pip install cryptography") from None
    return Cipher, algorithms, modes


def derive_key(secret: bytes, direction: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, b"tableserver-seal-" + direction + server_nonce + client_nonce, hashlib.sha256).digest()


class Direction:
    """One direction of a sealed connection: its key and frame counter."""

    def __init__(self, key: bytes):
        self.key = key
        self.counter = 0

    def _nonce(self) -> bytes:
        nonce = b"\0\0\0\0" + struct.pack("<Q", self.counter)
        self.counter += 1
        return nonce

    def encryptor(self, header: bytes):
        """A streaming encryptor for the next frame's payload (``header`` authenticated too)."""
        Cipher, algorithms, modes = _aead()
        enc = Cipher(algorithms.AES(self.key), modes.GCM(self._nonce())).encryptor()
        enc.authenticate_additional_data(header)
        return enc

    def decryptor(self, header: bytes):
        Cipher, algorithms, modes = _aead()
        # the tag comes after the payload: finalize_with_tag(tag) checks it
        dec = Cipher(algorithms.AES(self.key), modes.GCM(self._nonce())).decryptor()
        dec.authenticate_additional_data(header)
        return dec

    def seal(self, header: bytes, plaintext) -> bytes:
        """The whole payload at once: ciphertext + tag."""
        enc = self.encryptor(header)
        out = enc.update(bytes(plaintext)) + enc.finalize()
        return out + enc.tag

    def open_into(self, header: bytes, ciphertext, tag: bytes, out: memoryview) -> None:
        """Decrypts ``ciphertext`` into ``out`` and checks ``tag``; BadTag when the frame was tampered with."""
        dec = self.decryptor(header)
        crypt_into(dec, memoryview(ciphertext).cast("B"), memoryview(out).cast("B"))
        finish(dec, tag)


class BadTag(Exception):
    """A sealed frame failed authentication."""


_SLACK = 15  # cryptography's update_into wants room for one block beyond the data, even for GCM


def crypt_into(ctx, src: memoryview, dst: memoryview, step: int = 1 << 20) -> None:
    """``ctx.update_into`` over ``src`` into ``dst`` (same length), in steps, without a full-size temporary:
    each step writes into ``dst`` directly when it has the slack after it, else through a small buffer."""
    n = len(src)
    pos = 0
    tail = None
    while pos < n:
        m = min(step, n - pos)
        if pos + m + _SLACK <= len(dst):
            ctx.update_into(src[pos : pos + m], dst[pos : pos + m + _SLACK])
        else:
            if tail is None or len(tail) < m + _SLACK:
                tail = bytearray(m + _SLACK)
            ctx.update_into(src[pos : pos + m], tail)
            dst[pos : pos + m] = memoryview(tail)[:m]
        pos += m


def finish(dec, tag: bytes) -> None:
    from cryptography.exceptions import InvalidTag

    try:
        dec.finalize_with_tag(bytes(tag))
    except InvalidTag:
        raise BadTag("a sealed frame failed authentication: tampered with, replayed or out of order") from None
