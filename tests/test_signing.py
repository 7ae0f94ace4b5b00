"""Signed messages (issue 27 item 1): nothing is unpickled unless its signature holds for its topic
and sender. Pure checks of nbdist.protocol.signing, then the signed collectives on a 2-rank world."""

from __future__ import annotations

import pathlib
import pickle

import pytest

import nbdist
from nbdist.protocol.signing import (
    WORLD_KEY_ENV,
    SigningError,
    UnsignedMessageError,
    dumps_signed,
    loads_signed,
    new_world_key,
    open_signed,
    sign,
    world_key_from_env,
)

KEY = bytes(range(32))
KEY_HEX = KEY.hex()
TOPIC = "attach/gather/7"


class Probe:
    """Unpickling this creates ``path``: a refused load must leave no file behind."""

    def __init__(self, path):
        self.path = pathlib.Path(path)

    def __reduce__(self):
        return pathlib.Path.touch, (self.path,)


def _flip(blob: bytes, at: int) -> bytes:
    out = bytearray(blob)
    out[at] ^= 0x01
    return bytes(out)


def test_a_signed_object_comes_back_for_its_topic_and_sender(tmp_path):
    value = {"rank": 2, "data": list(range(100)), "text": "é"}
    assert loads_signed(KEY, dumps_signed(KEY, value, topic=TOPIC, sender=2), topic=TOPIC, sender=2) == value
    # The probe works: loaded with a signature that holds, it does create its file.
    probe = tmp_path / "ran"
    loads_signed(KEY, dumps_signed(KEY, Probe(probe), topic=TOPIC, sender=0), topic=TOPIC, sender=0)
    assert probe.exists()
    assert open_signed(KEY, sign(KEY, b"raw", topic=TOPIC, sender=1), topic=TOPIC, sender=1) == b"raw"


@pytest.mark.parametrize("how, reason", [
    ("flip a data byte", "signature does not match"),
    ("flip a MAC byte", "signature does not match"),
    ("flip the sender field", "header names rank 3"),
    ("flip the magic", "not a signed nbdist message"),
    ("truncate into the header", "not a signed nbdist message"),
    ("plain pickle", "not a signed nbdist message"),
    ("another topic", "signature does not match"),
    ("another sender", "header names rank 2"),
    ("another key", "signature does not match"),
])
def test_a_tampered_or_misdirected_message_is_refused_before_unpickling(tmp_path, how, reason):
    probe = tmp_path / "ran"
    blob = dumps_signed(KEY, Probe(probe), topic=TOPIC, sender=2)
    topic, sender, key = TOPIC, 2, KEY
    if how == "flip a data byte":
        blob = _flip(blob, len(blob) - 2)
    elif how == "flip a MAC byte":
        blob = _flip(blob, 8 + 5)
    elif how == "flip the sender field":
        blob = _flip(blob, 7)  # rank 2 -> rank 3
    elif how == "flip the magic":
        blob = _flip(blob, 0)
    elif how == "truncate into the header":
        blob = blob[:20]
    elif how == "plain pickle":
        blob = pickle.dumps(Probe(probe))
    elif how == "another topic":
        topic = "attach/gather/8"  # the same message replayed into the next round
    elif how == "another sender":
        sender = 1
    elif how == "another key":
        key = new_world_key()
    with pytest.raises(UnsignedMessageError, match=reason) as caught:
        loads_signed(key, blob, topic=topic, sender=sender)
    assert not probe.exists()
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"nbdist refused a message for {topic} ")
    assert f"claiming to come from rank {sender}" in message and "nothing of it was unpickled" in message
    assert (caught.value.topic, caught.value.sender) == (topic, sender)


def test_the_topic_is_length_prefixed_so_its_bytes_cannot_move_into_the_data(tmp_path):
    # Without the prefix, topic "t" + data b"\0\0\0\1" + X and topic "t\0\0\0\1" + data X would MAC alike.
    blob = sign(KEY, b"\x00\x00\x00\x01" + b"X", topic="t", sender=1)
    moved = blob[:40] + blob[44:]
    with pytest.raises(UnsignedMessageError, match="signature does not match"):
        open_signed(KEY, moved, topic="t\x00\x00\x00\x01", sender=1)


def test_the_refusal_survives_pickling_with_its_fields():
    err = UnsignedMessageError(TOPIC, 2, "its signature does not match")
    back = pickle.loads(pickle.dumps(err))
    assert (back.topic, back.sender, back.reason, str(back)) == (err.topic, err.sender, err.reason, str(err))
    assert isinstance(back, SigningError)


def test_without_a_key_objects_travel_as_plain_pickles(tmp_path):
    blob = dumps_signed(None, {"a": 1}, topic=TOPIC, sender=0)
    assert pickle.loads(blob) == {"a": 1}
    assert loads_signed(None, blob, topic="anything", sender=5) == {"a": 1}
    # A signed message that reaches a process without the key is refused, not guessed at.
    probe = tmp_path / "ran"
    with pytest.raises(SigningError, match=WORLD_KEY_ENV):
        loads_signed(None, dumps_signed(KEY, Probe(probe), topic=TOPIC, sender=0), topic=TOPIC, sender=0)
    assert not probe.exists()


def test_an_empty_key_signs_nothing():
    with pytest.raises(SigningError, match="non-empty"):
        sign(b"", b"data", topic=TOPIC, sender=0)


def test_the_world_key_comes_from_the_env_as_hex():
    key = new_world_key()
    assert len(key) == 32 and key != new_world_key()
    assert world_key_from_env({WORLD_KEY_ENV: key.hex()}) == key
    assert world_key_from_env({WORLD_KEY_ENV: f" {key.hex().upper()}\n"}) == key
    assert world_key_from_env({}) is None
    assert world_key_from_env({WORLD_KEY_ENV: ""}) is None


@pytest.mark.parametrize("value", ["not hex at all, but secret", "ab" * 16, "ab" * 33, "abc"])
def test_a_malformed_world_key_is_named_and_never_shown(value):
    with pytest.raises(SigningError, match=WORLD_KEY_ENV) as caught:
        world_key_from_env({WORLD_KEY_ENV: value})
    assert value not in str(caught.value) and "secret" not in str(caught.value)


def test_signed_collectives_gather_and_broadcast_on_a_real_world():
    import rankfns

    results = nbdist.launch(rankfns.signed_gather_roundtrip, KEY_HEX, nprocs=2)
    expected = [{"rank": 0, "pad": ""}, {"rank": 1, "pad": "x" * 1000}]
    assert results == {r: (expected, ["from", 1]) for r in (0, 1)}


def test_signed_collectives_refuse_a_rank_without_the_world_s_key():
    import rankfns

    results = nbdist.launch(rankfns.signed_gather_refuses_forgery, KEY_HEX, nprocs=2)
    refused = "its signature does not match (written by someone without this world's key, or for another topic)"
    # Rank 0 refuses rank 1's messages; rank 1 (another key) refuses rank 0's, and sent its own broadcast.
    assert results == {0: {"gather": (1, refused), "bcast": (1, refused)},
                       1: {"gather": (0, refused), "bcast": "forged"}}
