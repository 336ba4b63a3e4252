"""How many bytes sessions may hold, on the device and on the host, from the settings and
what this machine has (the engine's budget rule; capacity/ reuses it for sizing by arithmetic).

A setting that cannot fit fails the start in one line (``SettingsError``), before any session
exists.
"""

from __future__ import annotations

import os

import torch

from llava.config import EngineConfig, SettingsError
from llava.kv.memory import MemoryBudget


def device_split(config: EngineConfig, free: int) -> tuple[int, int]:
    """(bytes for sessions, headroom) out of ``free`` device bytes, by the settings: unset,
    the headroom is what ``session_budget_fraction`` leaves and sessions get the rest."""
    headroom = config.device_headroom_bytes
    if headroom is None:
        headroom = int(free * (1 - config.session_budget_fraction))
    return config.session_budget_bytes or free - headroom, headroom


# Unset host_budget_bytes: this share of the memory free on the host at start (the rest is the
# worker's own, the OS's and the page cache's).
DEFAULT_HOST_FRACTION = 0.25


def host_budget(config: EngineConfig) -> int:
    """The host tier's bytes for the whole worker (every shard together), from the settings
    and the memory free on this host; more than it has fails the start (SettingsError)."""
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    host = config.host_budget_bytes
    if host is None:
        return int(available * DEFAULT_HOST_FRACTION)
    if host > available:
        raise SettingsError(
            "host_budget_bytes",
            f"{host} is more than the {available} bytes of memory free on this host",
        )
    return host


def memory_budget(
    config: EngineConfig, device: torch.device, *, host_bytes: int | None = None, sharing: int = 1
) -> MemoryBudget:
    """The memory manager's budget from the settings and what this machine has; a setting
    that cannot fit fails the start with one line (SettingsError). ``host_bytes``: this
    engine's share of the host tier (default: all of ``host_budget``); ``sharing``: engines
    on ``device``, which split its free memory evenly (docs/engine/scheduling.md §Engine shards)."""
    host = host_budget(config) if host_bytes is None else host_bytes
    if device.type != "cuda":
        device_bytes = config.session_budget_bytes or config.cpu_session_budget_bytes
        return MemoryBudget(device_bytes, host, config.device_headroom_bytes or 0)
    free = torch.cuda.mem_get_info(device)[0] // sharing
    device_bytes, headroom = device_split(config, free)
    if device_bytes + headroom > free or device_bytes <= 0:
        share = "" if sharing == 1 else f" (its 1/{sharing} share for the shards there)"
        raise SettingsError(
            "session_budget_bytes",
            f"{device_bytes} bytes for sessions plus "
            f"{headroom} bytes of headroom (device_headroom_bytes) do not fit the {free} "
            f"bytes free on {device}{share}",
        )
    return MemoryBudget(device_bytes, host, headroom)
