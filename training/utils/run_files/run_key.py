"""The run's own secret key, which signs what a resume trusts: each checkpoint's manifest, and through it the
progress and the dataset's fingerprint it records.

Checksums catch accidents, not an adversary: whoever rewrites a file can rewrite its checksum too. The key is 32
random bytes in `<log_path>/run.key` (0600), made by the run's first checkpoint; the run directory is hidden from
every agent's sandbox (`training/utils/sandbox/namespaces.py`), so an agent can neither read the key nor replace it. A
checkpoint's `checksums.json` carries an HMAC-SHA256 of its file entries under that key; on load a missing or
wrong signature refuses the checkpoint by name, as a changed file does.

What it does not stop: a process outside the sandbox that can write the run directory (it can replace the key as
well), and a checkpoint moved away from its run's `run.key` (copy the key with it, or load it with
`allow_unverified_checkpoint=True`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path
from typing import Any

KEY_FILE = "run.key"
_KEY_BYTES = 32


def key_of(run_dir: str | Path, *, create: bool = False) -> bytes | None:
    """The key of the run in `run_dir`; made (0600, atomically) when `create` and there is none; else None."""
    path = Path(run_dir) / KEY_FILE
    try:
        return bytes.fromhex(path.read_text().strip())
    except FileNotFoundError:
        if not create:
            return None
    except ValueError as exc:
        raise ValueError(f"{path} is not a run key ({exc}); remove it only if no checkpoint of this run is kept") \
            from None
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{KEY_FILE}.{os.getpid()}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(_KEY_BYTES))
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(temporary, path)  # never replaces a key another process made meanwhile
    except FileExistsError:
        pass
    finally:
        os.unlink(temporary)
    return key_of(run_dir)


def signature(key: bytes, entries: dict[str, Any]) -> str:
    """HMAC-SHA256 under `key` of `entries` as canonical JSON."""
    canonical = json.dumps(entries, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, canonical, hashlib.sha256).hexdigest()


def sign(run_dir: str | Path, entries: dict[str, Any]) -> dict[str, str]:
    """The manifest fields that sign `entries` with the key of the run in `run_dir` (made if it has none)."""
    return {"hmac": signature(key_of(run_dir, create=True), entries)}


def signature_problem(run_dir: str | Path, manifest: Path) -> str | None:
    """Why the signature in `manifest` does not prove its entries were written by the run in `run_dir`, or None."""
    try:
        content = json.loads(manifest.read_text())
        entries, tag = content["files"], content.get("hmac")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{manifest} is unreadable ({exc!r})"
    key = key_of(run_dir)
    where = Path(run_dir) / KEY_FILE
    if tag is None:
        return None if key is None else (f"{manifest} is not signed, though this run signs its checkpoints ({where}): "
                                         "its files may have been rewritten with their checksums")
    if key is None:
        return (f"{manifest} is signed, but its run's key {where} is missing: copy the run key with a checkpoint, "
                "or set allow_unverified_checkpoint=True to load it unverified")
    if not hmac.compare_digest(str(tag), signature(key, entries)):
        return (f"{manifest} does not carry this run's signature ({where}): its files and checksums were rewritten "
                "by someone without the run key")
    return None
