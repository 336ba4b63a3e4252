"""Files written whole or not at all: what the persistent tier and the weights' digest record
write into their directories (llava.sessions.persist, llava.model.weights_digest)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

TEMP_PREFIX = ".tmp-"  # an unfinished write's name: whoever owns the directory removes it


def write_atomically(path: Path, data: bytes) -> None:
    """Temp file (0600, never through a link), fsync, rename, fsync of the directory: a crash
    leaves the old file or the new one, never part of either."""
    temp = path.with_name(f"{TEMP_PREFIX}{path.name}-{os.getpid()}-{threading.get_ident()}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
