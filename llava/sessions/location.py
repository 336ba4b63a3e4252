"""Where the persistent tier lives (docs/engine/sessions.md §Persistent tier): its directory
from the settings, checked at start (this user's own and private, writable, within its file
system), and how many bytes it may hold. A directory that cannot be used fails the start in
one line (SettingsError)."""

from __future__ import annotations

import logging
import os
import shutil
import stat
from pathlib import Path
from typing import NamedTuple

from llava.config import EngineConfig, SettingsError
from llava.files import TEMP_PREFIX
from llava.sessions.persist import NoJournal, SessionJournal

logger = logging.getLogger(__name__)


class Location(NamedTuple):
    directory: str
    max_bytes: int


def persistence(config: EngineConfig) -> Location | None:
    """Where the persistent tier lives and how many bytes it may hold, said in one log line
    (None: the tier is off). Unless ``persist_max_bytes`` says, the cap is measured: half the
    directory's file system. Below ``persist_min_bytes`` (Docker's default /dev/shm is 64 MB)
    ``persist_fallback_dir`` is used instead, if it holds at least as much (docs/engine/sessions.md
    §Persistent tier). A directory that cannot be written fails the start (SettingsError)."""
    directory, max_bytes = config.persist_dir, config.persist_max_bytes
    min_bytes, fallback_dir = config.persist_min_bytes, config.persist_fallback_dir
    if directory is None:
        return None
    cap = check_directory(directory, max_bytes)
    if max_bytes is None and cap < min_bytes and fallback_dir is not None:
        fallback_cap = check_directory(fallback_dir, None, "persist_fallback_dir")
        if fallback_cap >= cap:  # never a smaller one
            logger.warning(
                "persistent tier: %s holds only %d MiB, under persist_min_bytes (%d MiB): "
                "using %s instead, up to %d MiB",
                directory, cap >> 20, min_bytes >> 20, fallback_dir, fallback_cap >> 20,
            )  # fmt: skip
            return Location(fallback_dir, fallback_cap)
    logger.info("persistent tier: %s, up to %d MiB", directory, cap >> 20)
    return Location(directory, cap)


def check_directory(directory: str, max_bytes: int | None, setting: str = "persist_dir") -> int:
    """Create (0700) and try the directory; return the byte cap. A bad one is a SettingsError:
    one that is not this user's own and private (``check_private``) is never used."""
    path = Path(directory)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_private(path, setting)
        probe = path / f"{TEMP_PREFIX}probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        problem = f"{directory} is not a writable directory ({e})"
        raise SettingsError(setting, problem) from None
    size = shutil.disk_usage(path).total
    if max_bytes is None:
        return size // 2
    if max_bytes > size:
        raise SettingsError(
            "persist_max_bytes", f"{max_bytes} is more than {directory}'s {size}-byte file system"
        )
    return max_bytes


def check_private(path: Path, setting: str) -> None:
    """The directory must be this user's and writable by no one else: on a shared host (a
    fixed path in a shared tmpfs) another user could have made it first, to read the sessions
    or plant entries. Our own that others may only read (an older start's 0755) is narrowed.
    Each directory above it must be root's or ours, and writable by others only with the
    sticky bit (as /dev/shm and /tmp are), or it could be renamed away and replaced."""
    found = path.lstat()
    if stat.S_ISLNK(found.st_mode):
        raise SettingsError(setting, f"{path} is a symbolic link; give a real directory")
    if found.st_uid != os.geteuid():
        problem = f"{path} belongs to uid {found.st_uid}, not this user ({os.geteuid()})"
        raise SettingsError(setting, problem + "; remove it or give another directory")
    if found.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problem = f"{path} is writable by its group or others (mode {found.st_mode & 0o777:o})"
        raise SettingsError(setting, problem + "; remove it or give another directory")
    if found.st_mode & 0o077:
        path.chmod(0o700)
    for parent in path.absolute().parents:  # one who may rename it could swap it afterwards
        above = parent.stat()
        shared = above.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not above.st_mode & stat.S_ISVTX
        if above.st_uid not in (0, os.geteuid()) or shared:
            problem = f"{parent}, above it, may be changed by another user"
            raise SettingsError(setting, problem + "; give a directory under a safe one")


def open_journal(
    location: Location | None, model: str, vocab_size: int, ttl_s: float
) -> SessionJournal | NoJournal:
    """The engine's journal at ``location`` (``persistence``'s; None: the tier is off)."""
    if location is None:
        return NoJournal()
    return SessionJournal(location.directory, location.max_bytes, model, vocab_size, ttl_s)
