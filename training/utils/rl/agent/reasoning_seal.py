"""The `encrypted_content` of a Responses reasoning item: the sampled reasoning, sealed so a client can carry it but
never change it.

With `store: false` a Responses client keeps the conversation itself and sends every reasoning
item back as it received it. Codex sends back only the item's `summary` and `encrypted_content`
(it drops `content`, where the reasoning text also is), so `encrypted_content` must hold the
reasoning itself for the next prompt to show the model what it wrote. It is ours to encode:

    shim-rs1.<base64url of the JSON [reasoning, reply identity]>.<base64url of its HMAC-SHA256>

The HMAC key is derived from a secret drawn when the process starts and the session's key, so a
blob opens only in the session it was issued in; the payload names the reply the reasoning came
with (its `turn_matching.unit_hash` identity), so it opens only next to that reply. A blob
altered, forged, from another session or moved to another reply is a 400: a client can never
have reasoning rendered as the model's own that the model did not write. The blob is
authenticated, not encrypted: the reasoning is the client's to read anyway.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets

from training.utils.rl.agent.chat_request import WireError

_VERSION = "shim-rs1"
_PROCESS_SECRET = secrets.token_bytes(32)


class ReasoningSeal:
    """Seals and opens reasoning blobs for one session (`session_key`)."""

    def __init__(self, session_key: str):
        self._key = hmac.new(_PROCESS_SECRET, session_key.encode(), hashlib.sha256).digest()

    def seal(self, reasoning: str, reply_identity: str) -> str:
        """The blob that `open` turns back into `reasoning`, next to the reply whose identity is `reply_identity`."""
        payload = _b64(json.dumps([reasoning, reply_identity], ensure_ascii=False).encode())
        return f"{_VERSION}.{payload}.{_b64(self._tag(payload))}"

    def open(self, blob: str, param: str) -> tuple[str, str]:
        """(reasoning, reply identity) of a blob this session sealed; a WireError 400 naming `param` otherwise."""
        version, _, rest = blob.partition(".")
        payload, _, tag = rest.partition(".")
        try:
            authentic = version == _VERSION and hmac.compare_digest(_unb64(tag), self._tag(payload))
            value = json.loads(_unb64(payload)) if authentic else None
        except (ValueError, binascii.Error):
            value = None
        if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value)):
            raise WireError(f"{param} is not a reasoning item this session was sent (altered, forged, or from "
                            "another session): send back encrypted_content exactly as it came", param=param)
        return value[0], value[1]

    def _tag(self, payload: str) -> bytes:
        return hmac.new(self._key, f"{_VERSION}.{payload}".encode(), hashlib.sha256).digest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    if not text.isascii():
        raise ValueError("not base64")
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
