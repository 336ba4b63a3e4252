"""A digest of a checkpoint's weight values: what tells a fine-tune from the model it was
tuned from when their shapes are the same (the persistent tier's model identity).

SHA-256 over every weight file (``*.safetensors``, ``*.bin``) of the model dir, streamed,
computed once: the result is kept in a record in a directory of the caller's (the persistent
tier's own, never the model dir, which may be read-only as /opt/ml/model is on SageMaker) and
in this process, both keyed by each file's path, size, mtime and inode, so a restarted worker
or a second engine shard does not rehash 14 GB; a file rewritten since is hashed again.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from llava.files import write_atomically

logger = logging.getLogger(__name__)

RECORD = "weights.sha256.json"
WEIGHT_FILES = ("*.safetensors", "*.bin")  # what from_pretrained reads weights from
_CHUNK = 16 << 20
_known: dict[str, str] = {}  # this process's digests, by the files' stat key


def weights_digest(model_dir: str | Path, record_dir: str | Path) -> str:
    """The hex digest of ``model_dir``'s weights, from a current record in ``record_dir``
    if there is one, else hashed and recorded there."""
    files = sorted(f for pattern in WEIGHT_FILES for f in Path(model_dir).resolve().glob(pattern))
    if not files:
        raise FileNotFoundError(f"no weight files ({', '.join(WEIGHT_FILES)}) in {model_dir}")
    key = _stat_key(files)
    record = Path(record_dir) / RECORD
    recorded = _recorded(record, key)
    digest = recorded or _known.get(key) or _hash(files)
    if recorded is None:
        try:
            _write_record(record, key, digest)
        except OSError as e:  # only the next start pays: it hashes again
            logger.warning("weights digest not recorded in %s: %s", record_dir, e.strerror)
    _known[key] = digest
    return digest


def _stat_key(files: list[Path]) -> str:
    stats = [(str(f), s.st_size, s.st_mtime_ns, s.st_ino) for f in files for s in [f.stat()]]
    return json.dumps(stats)


def _recorded(record: Path, key: str) -> str | None:
    try:
        found = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(found, dict) or found.get("files") != key:
        return None  # another model, or a file changed since
    return found.get("sha256")


def _hash(files: list[Path]) -> str:
    whole = hashlib.sha256()
    for path in files:
        one = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                one.update(chunk)
        whole.update(f"{path.name} {one.hexdigest()}\n".encode())
    return whole.hexdigest()


def _write_record(record: Path, key: str, digest: str) -> None:
    # private, whole or absent (an unfinished one is what the persistent tier removes at load)
    write_atomically(record, json.dumps({"files": key, "sha256": digest}).encode())
