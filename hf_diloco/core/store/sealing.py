"""Every object a site writes is sealed with the job's secret, and every object a site reads is verified before it
is parsed.

An object is `MAGIC`, a little-endian uint32 header length, the header (JSON: what the object is, for which job,
fragment, round and site, and the payload's length and SHA-256), the HMAC-SHA256 of all of that under the job's key,
then the payload. The HMAC covers the payload through its hash, so a reader that only needs the header (the site
closing a round reads each contribution's record) reads only the header, and a reader of the payload checks its hash.
Nothing of an object is parsed before its MAC verifies, a header is at most `MAX_HEADER` bytes, and a payload must
have exactly the length the reader expects: a header that claims 10^12 elements is refused before any allocation.

A sealed object names what it is; the reader says what it expects (`expect`) and refuses an object whose header
differs: an object copied from another round, fragment, site or job (a replay) verifies but is refused all the same.

With the job's secret, the payloads that hold the model's values (shares of a contribution, snapshots) are also
encrypted (encrypt-then-MAC): XORed with SHAKE-256 of a key derived from the secret and the object's own name (unique:
every such object is written once), so whoever can read the store but lacks the secret learns nothing of θg or of a
pseudo-gradient. SHAKE-256 is an extendable-output function, and keyed with a secret it is a stream cipher (the
construction of KMAC, NIST SP 800-185); hashlib computes it at hundreds of MB/s.

Object names carry a tag (`JobKeys.tag`): the HMAC of the name without it. A stranger without the secret cannot
compute the name of a round's manifest before it is written, so it cannot take that name first (a create-if-absent
would then keep the job's own manifest out), and a listing's keys whose tag does not verify are ignored.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct

import torch

MAGIC = b"HFDLSEAL1"
MAX_HEADER = 1 << 22
_PREFIX = len(MAGIC) + 4
_MAC = 32
KEY_CONTEXT = b"hf_diloco store v1"
ENCRYPTION_CONTEXT = b"hf_diloco store encryption v1"


class UntrustedObject(ValueError):
    """An object that is not what the job wrote: unsigned, signed with another secret, truncated, too long, or
    another object's (round, fragment, site, job)."""


class JobKeys:
    """The keys of one job, derived from its secret.

    Args:
        secret: the job's secret (`settings.secret.job_secret`), or None.
        insecure: run without a secret (`insecure_no_secret`): objects are still sealed, under a key everybody
            knows, which detects a truncated or corrupted object but not a stranger's.
    """

    def __init__(self, secret: bytes | None, insecure: bool = False):
        if secret is None and not insecure:
            raise ValueError(
                "exchange 'store' needs the job's secret, so that no stranger with access to the store can put "
                "anything into the model: set HF_DILOCO_JOB_SECRET_FILE to a file holding it (or HF_DILOCO_JOB_SECRET) "
                "on every site, the same on all of them. On a store nobody else can write, insecure_no_secret: true "
                "runs without one."
            )
        self.authenticated = secret is not None
        source = secret if secret is not None else b"hf_diloco: no secret (insecure_no_secret)"
        self._key = hmac.new(source, KEY_CONTEXT, hashlib.sha256).digest()
        self._cipher = hmac.new(source, ENCRYPTION_CONTEXT, hashlib.sha256).digest() if secret is not None else None

    def tag(self, name: str) -> str:
        """16 hex digits only the job's sites can compute for `name`."""
        return hmac.new(self._key, b"name\0" + name.encode(), hashlib.sha256).hexdigest()[:16]

    def mac(self, data: bytes | memoryview) -> bytes:
        return hmac.new(self._key, data, hashlib.sha256).digest()

    @property
    def encrypts(self) -> bool:
        return self._cipher is not None

    def crypt(self, payload: bytes | memoryview, name: str) -> bytes:
        """`payload` XOR the keystream of object `name` (encrypts and decrypts alike)."""
        if not len(payload):
            return b""
        stream = hashlib.shake_256(self._cipher + b"\0" + name.encode()).digest(len(payload))
        mixed = torch.bitwise_xor(
            torch.frombuffer(bytearray(payload), dtype=torch.uint8),
            torch.frombuffer(bytearray(stream), dtype=torch.uint8),
        )
        return mixed.numpy().tobytes()


def seal(keys: JobKeys, header: dict, payload: bytes | memoryview = b"", encrypt_as: str | None = None) -> bytes:
    """The sealed object: `header` plus the payload's length and SHA-256, MAC'd, then the payload; with `encrypt_as`
    (the object's name) and the job's secret, the payload encrypted first."""
    if encrypt_as is not None and keys.encrypts:
        payload, header = keys.crypt(payload, encrypt_as), {**header, "encrypted": True}
    full = {**header, "payload_bytes": len(payload), "payload_sha256": hashlib.sha256(payload).hexdigest()}
    text = json.dumps(full, sort_keys=True, separators=(",", ":")).encode()
    if len(text) > MAX_HEADER:
        raise ValueError(f"a store object's header of {len(text)} bytes is over {MAX_HEADER}")
    head = MAGIC + struct.pack("<I", len(text)) + text
    return b"".join((head, keys.mac(head), bytes(payload)))


def header_bytes_needed(prefix: bytes) -> int:
    """How many bytes of an object hold its header and MAC, from its first `_PREFIX` bytes (0: not an object)."""
    if len(prefix) < _PREFIX or not prefix.startswith(MAGIC):
        return 0
    (length,) = struct.unpack_from("<I", prefix, len(MAGIC))
    return _PREFIX + length + _MAC if length <= MAX_HEADER else 0


def open_header(keys: JobKeys, data: bytes | memoryview, expect: dict, name: str) -> dict:
    """The header of the sealed object whose first bytes are `data`, once its MAC verifies and it is what `expect`
    says (every key of `expect` equal); `UntrustedObject` naming `name` otherwise."""
    data = memoryview(data)
    needed = header_bytes_needed(bytes(data[:_PREFIX]))
    if not needed:
        raise UntrustedObject(
            f"{name} is not a store object of hf_diloco (no header, or a header over {MAX_HEADER} B)"
        )
    if len(data) < needed:
        raise UntrustedObject(f"{name} is truncated ({len(data)} bytes, its header needs {needed})")
    head, mac = data[: needed - _MAC], data[needed - _MAC : needed]
    if not hmac.compare_digest(keys.mac(head), bytes(mac)):
        raise UntrustedObject(
            f"{name} is not signed with this job's secret (forged, corrupted, or written by a job with another secret)"
        )
    header = json.loads(bytes(head[_PREFIX:]))
    for key, value in expect.items():
        if header.get(key) != value:
            raise UntrustedObject(
                f"{name} is another object's ({key} {header.get(key)!r} where this one is {value!r}): a replay from "
                "another round, fragment, site or job"
            )
    return header


def unseal(
    keys: JobKeys, data: bytes | memoryview, expect: dict, payload_bytes: int | None, name: str
) -> tuple[dict, memoryview]:
    """(header, payload) of a whole sealed object, verified (see `open_header`), its payload exactly `payload_bytes`
    long (None: any length the header states) and matching its SHA-256."""
    data = memoryview(data)
    header = open_header(keys, data, expect, name)
    start = header_bytes_needed(bytes(data[:_PREFIX]))
    stated = header.get("payload_bytes")
    if payload_bytes is not None and stated != payload_bytes:
        raise UntrustedObject(f"{name} states a payload of {stated} bytes where {payload_bytes} are expected")
    payload = data[start:]
    if len(payload) != stated:
        raise UntrustedObject(
            f"{name} holds {len(payload)} payload bytes where its header states {stated} (truncated)"
        )
    if hashlib.sha256(payload).hexdigest() != header.get("payload_sha256"):
        raise UntrustedObject(f"{name}'s payload does not match its signed hash (corrupted or altered)")
    if header.get("encrypted"):
        return header, memoryview(keys.crypt(payload, name))
    return header, payload


def sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()
