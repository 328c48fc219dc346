"""Sans-I/O pieces of the connection handshake.

Exchange (the dialer is the side that opened the TCP connection)::

    dialer   -> listener : HELLO(dialer)            CRC frame
    listener -> dialer   : HELLO(listener)          CRC frame
    -- secret mode only; both derive keys from the secret and both HELLOs --
    dialer   -> listener : AUTH(dialer proof)       first MAC'd frame d->l
    listener -> dialer   : AUTH(listener proof)     first MAC'd frame l->d

A listener validates the dialer's HELLO before revealing anything and only
answers AUTH after checking the dialer's proof, so an anonymous connector never
gets a value computed from the secret to attack offline. The HELLOs carry a
fresh random nonce each, and the keys and proofs are derived from a hash of
both HELLOs, so an old session's AUTH (or its MAC'd frames) never verifies in a
new session, and a proof cannot be reflected between roles or identities.

HELLO payload (little-endian)::

    version u16 | node_id u64 | expect_peer u64 | flags u8 | nonce 16s |
    cluster_len u16 | cluster_id utf-8

``expect_peer`` is the node id the sender believes it is talking to (the
listener echoes the dialer's id), which catches a miswired address book.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import secrets
import struct
from dataclasses import dataclass

from dledger.errors import DLedgerError

PROTOCOL_VERSION = 1
NONCE_SIZE = 16
HELLO_FLAG_SECRET = 0x01
MAX_CLUSTER_ID_BYTES = 255
MAX_NODE_ID = 0xFFFF_FFFF_FFFF_FFFF
# Handshake frames are tiny; capping them keeps an unauthenticated peer from
# making us buffer up to the data-frame limit.
MAX_HANDSHAKE_FRAME = 1024

_HELLO = struct.Struct("<HQQB16sH")
_LABEL = b"dledger-transport/v1"


class HandshakeError(DLedgerError):
    """The peer is not someone we talk to; the connection must close."""

    code = "HANDSHAKE_REJECTED"


class Role(enum.Enum):
    DIALER = "dialer"
    LISTENER = "listener"


@dataclass(frozen=True, slots=True)
class Hello:
    version: int
    node_id: int
    expect_peer: int
    has_secret: bool
    nonce: bytes
    cluster_id: str

    @staticmethod
    def fresh(cluster_id: str, node_id: int, expect_peer: int, has_secret: bool) -> Hello:
        return Hello(
            version=PROTOCOL_VERSION,
            node_id=node_id,
            expect_peer=expect_peer,
            has_secret=has_secret,
            nonce=secrets.token_bytes(NONCE_SIZE),
            cluster_id=cluster_id,
        )


def encode_hello(h: Hello) -> bytes:
    cid = h.cluster_id.encode("utf-8")
    if len(cid) > MAX_CLUSTER_ID_BYTES:
        raise ValueError(f"cluster id is {len(cid)} bytes, limit {MAX_CLUSTER_ID_BYTES}")
    if len(h.nonce) != NONCE_SIZE:
        raise ValueError(f"nonce must be {NONCE_SIZE} bytes")
    flags = HELLO_FLAG_SECRET if h.has_secret else 0
    return _HELLO.pack(h.version, h.node_id, h.expect_peer, flags, h.nonce, len(cid)) + cid


def decode_hello(payload: bytes) -> Hello:
    if len(payload) < _HELLO.size:
        raise HandshakeError(f"HELLO too short: {len(payload)} bytes")
    version, node_id, expect_peer, flags, nonce, n = _HELLO.unpack_from(payload, 0)
    if len(payload) != _HELLO.size + n:
        raise HandshakeError("HELLO length does not match its cluster id length")
    if flags & ~HELLO_FLAG_SECRET:
        raise HandshakeError(f"unknown HELLO flags 0x{flags:02x}")
    try:
        cluster_id = payload[_HELLO.size :].decode("utf-8")
    except UnicodeDecodeError:
        raise HandshakeError("HELLO cluster id is not UTF-8") from None
    return Hello(
        version=version,
        node_id=node_id,
        expect_peer=expect_peer,
        has_secret=bool(flags & HELLO_FLAG_SECRET),
        nonce=nonce,
        cluster_id=cluster_id,
    )


def check_hello(
    theirs: Hello, *, cluster_id: str, node_id: int, has_secret: bool, expect_node: int | None
) -> None:
    """Raise :class:`HandshakeError` unless ``theirs`` may talk to us.

    ``expect_node`` is the id the dialer dialed; ``None`` on the listener side,
    where membership is checked by the caller.
    """
    if theirs.version != PROTOCOL_VERSION:
        raise HandshakeError(
            f"peer speaks protocol version {theirs.version}, we speak {PROTOCOL_VERSION}"
        )
    if theirs.cluster_id != cluster_id:
        raise HandshakeError(f"peer belongs to cluster {theirs.cluster_id!r}, not {cluster_id!r}")
    if theirs.has_secret != has_secret:
        raise HandshakeError(
            "peer requires a cluster secret and we have none"
            if theirs.has_secret
            else "peer has no cluster secret and we require one"
        )
    if theirs.node_id == node_id:
        raise HandshakeError(f"peer claims our own node id {node_id}")
    if expect_node is not None and theirs.node_id != expect_node:
        raise HandshakeError(f"dialed node {expect_node} but node {theirs.node_id} answered")
    if theirs.expect_peer != node_id:
        raise HandshakeError(f"peer expected node {theirs.expect_peer}, we are {node_id}")


@dataclass(frozen=True, slots=True)
class SessionKeys:
    send_key: bytes
    recv_key: bytes
    local_proof: bytes
    peer_proof: bytes


def _prf(key: bytes, label: bytes) -> bytes:
    return hmac.new(key, label, hashlib.sha256).digest()


def derive_session(
    secret: bytes, role: Role, dialer_hello: bytes, listener_hello: bytes
) -> SessionKeys:
    """Keys and proofs for one connection, from the secret and both raw HELLOs.

    Hashing the raw HELLO bytes (not just the nonces) binds the keys to both
    identities, the cluster id and the versions; the length prefixes keep the
    split between the two HELLOs unambiguous.
    """
    transcript = hashlib.sha256()
    transcript.update(_LABEL)
    for part in (dialer_hello, listener_hello):
        transcript.update(len(part).to_bytes(4, "little"))
        transcript.update(part)
    prk = _prf(secret, transcript.digest())
    d2l = _prf(prk, b"key dialer->listener")
    l2d = _prf(prk, b"key listener->dialer")
    proof_d = _prf(prk, b"proof dialer")
    proof_l = _prf(prk, b"proof listener")
    if role is Role.DIALER:
        return SessionKeys(send_key=d2l, recv_key=l2d, local_proof=proof_d, peer_proof=proof_l)
    return SessionKeys(send_key=l2d, recv_key=d2l, local_proof=proof_l, peer_proof=proof_d)


def proof_matches(expected: bytes, got: bytes) -> bool:
    return hmac.compare_digest(expected, got)
