"""Signed messages between the processes of one world: nothing is unpickled unless its signature holds.

Threat model. Trusted: the job's own processes on the job's hosts (the kernels and ranks that hold
the world's key). Not trusted: other users on those hosts and the rest of the network, who can reach
a store's or a listener's port and write bytes into it. Out of nbdist's reach: torch's own c10d,
gloo and NCCL traffic, which torch neither authenticates nor encrypts.

A signed blob is ``b"NBS1" | sender (4 bytes, big-endian) | HMAC-SHA256 (32 bytes) | data``. The MAC
covers the magic, the topic (length-prefixed, so "a"+"bc" and "ab"+"c" differ), the sender and the
data: a message replayed into another round, cell or key (another topic), or passed off as another
rank's, fails. Signing gives integrity, not secrecy: anyone who can read the traffic reads the data.

``key=None`` is the documented mode without a shared key: :func:`dumps_signed` and
:func:`loads_signed` fall back to plain pickles, as torch's object collectives do. Standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import secrets
from collections.abc import Mapping

__all__ = ["WORLD_KEY_ENV", "KEY_BYTES", "SigningError", "UnsignedMessageError", "new_world_key",
           "world_key_from_env", "sign", "open_signed", "dumps_signed", "loads_signed"]

WORLD_KEY_ENV = "NBDIST_WORLD_KEY"  # hex of the world's key, as nbdist hands it to processes it starts
KEY_BYTES = 32
_MAGIC = b"NBS1"
_MAC_BYTES = hashlib.sha256().digest_size
_HEADER_BYTES = len(_MAGIC) + 4 + _MAC_BYTES


class SigningError(RuntimeError):
    """A world key that can't be used (malformed, empty), or a message that can't be signed or read."""


class UnsignedMessageError(SigningError):
    """A message whose signature does not hold for its topic and sender: refused before any unpickling.

    Attributes
    ----------
    topic : str
        The round, cell or key the receiver expected the message for.
    sender : int
        The rank the message claimed to come from.
    reason : str
        Why it was refused, in words.
    """

    def __init__(self, topic: str, sender: int, reason: str):
        self.topic, self.sender, self.reason = topic, sender, reason
        super().__init__(f"nbdist refused a message for {topic} claiming to come from rank {sender}: {reason}; "
                         f"nothing of it was unpickled")

    def __reduce__(self):  # the one-line message is built from these, not passed in: keep it picklable
        return type(self), (self.topic, self.sender, self.reason)


def new_world_key() -> bytes:
    """Return a fresh random key for one world (32 bytes from :mod:`secrets`)."""
    return secrets.token_bytes(KEY_BYTES)


def world_key_from_env(env: Mapping[str, str] = os.environ) -> bytes | None:
    """Return the world key that ``$NBDIST_WORLD_KEY`` holds, or None where it is unset or empty.

    Parameters
    ----------
    env : Mapping[str, str]
        Where to look; the process's environment by default.

    Raises
    ------
    SigningError
        The value is not the hex of a 32-byte key. The message never shows the value: it is a secret.
    """
    text = env.get(WORLD_KEY_ENV, "").strip()
    if not text:
        return None
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = None
    if key is None or len(key) != KEY_BYTES:
        raise SigningError(f"${WORLD_KEY_ENV} is not the hex of a {KEY_BYTES}-byte key ({len(text)} characters); "
                           f"nbdist sets it for the processes it starts: unset it, or set it to a 64-digit hex key")
    return key


def _compute_mac(key: bytes, topic: str, sender_field: bytes, data) -> bytes:
    if not isinstance(key, (bytes, bytearray)) or not key:
        raise SigningError("a world key must be non-empty bytes")
    topic_bytes = topic.encode("utf-8")
    mac = hmac.new(key, _MAGIC, hashlib.sha256)
    mac.update(len(topic_bytes).to_bytes(4, "big"))  # the length prefix keeps topic and sender apart
    mac.update(topic_bytes)
    mac.update(sender_field)
    mac.update(data)  # updated in parts: a big payload is never copied to be signed
    return mac.digest()


def _pack_sender(sender: int) -> bytes:
    if not 0 <= sender < 2**32:
        raise SigningError(f"sender {sender} is no rank that fits a signed message's 4-byte field")
    return sender.to_bytes(4, "big")


def sign(key: bytes, data: bytes, *, topic: str, sender: int) -> bytes:
    """Return ``data`` signed for ``topic`` by rank ``sender``: a 40-byte header, then ``data``.

    Parameters
    ----------
    key : bytes
        The world's key.
    data : bytes-like
        What to send (usually a pickle).
    topic : str
        What the message is for (``"attach/gather/7"``); a receiver that expects another topic refuses it.
    sender : int
        The global rank that writes it.
    """
    sender_field = _pack_sender(sender)
    return b"".join((_MAGIC, sender_field, _compute_mac(key, topic, sender_field, data), data))


def open_signed(key: bytes, blob, *, topic: str, sender: int) -> bytes:
    """Return the data of ``blob`` once its signature holds for ``topic`` and ``sender``.

    Raises
    ------
    UnsignedMessageError
        ``blob`` is not a signed message, names another sender, or its MAC does not match.
    """
    view = memoryview(blob).cast("B")
    if len(view) < _HEADER_BYTES or view[:len(_MAGIC)] != _MAGIC:
        raise UnsignedMessageError(topic, sender, "it is not a signed nbdist message (too short, or no header)")
    expected_field = _pack_sender(sender)
    if view[4:8] != expected_field:
        # The header is not yet trusted: it only says what the MAC check below would also refuse.
        named = int.from_bytes(view[4:8], "big")
        raise UnsignedMessageError(topic, sender, f"its header names rank {named} as its writer")
    data = view[_HEADER_BYTES:]
    if not hmac.compare_digest(view[8:_HEADER_BYTES], _compute_mac(key, topic, expected_field, data)):
        raise UnsignedMessageError(topic, sender, "its signature does not match (written by someone without "
                                                  "this world's key, or for another topic)")
    return bytes(data)


def dumps_signed(key: bytes | None, obj, *, topic: str, sender: int) -> bytes:
    """Pickle ``obj`` and sign it (:func:`sign`); with ``key=None``, a plain pickle (no shared key)."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return data if key is None else sign(key, data, topic=topic, sender=sender)


def loads_signed(key: bytes | None, blob, *, topic: str, sender: int):
    """Check ``blob`` (:func:`open_signed`), then unpickle it; with ``key=None``, a plain unpickle.

    The ``key=None`` mode trusts whoever could write ``blob``, as torch's object collectives do; it
    is what a world without a shared key gets. A signed blob that reaches it is refused, not guessed at.

    Raises
    ------
    UnsignedMessageError
        The signature does not hold (nothing was unpickled).
    SigningError
        ``key`` is None but ``blob`` is signed: the two ends disagree on the world's key.
    """
    if key is not None:
        return pickle.loads(open_signed(key, blob, topic=topic, sender=sender))
    # Pickles of protocol 2 and up begin with b"\x80": a plain one never starts with the magic.
    if bytes(memoryview(blob)[:len(_MAGIC)]) == _MAGIC:
        raise SigningError(f"a signed message for {topic} from rank {sender} reached a process without "
                           f"the world's key (${WORLD_KEY_ENV} unset here); nothing of it was unpickled")
    return pickle.loads(blob)
