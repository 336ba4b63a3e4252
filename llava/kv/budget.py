"""How many bytes sessions may hold, on the device and on the host, from the settings and
what this machine has (the engine's budget rule; capacity/ reuses it for sizing by arithmetic).

A setting that cannot fit fails the start in one line (``SettingsError``), before any session
exists.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from llava.config import EngineConfig, SettingsError


@dataclass(frozen=True)
class MemoryBudget:
    """``device_bytes``: the pool (KV and features); ``headroom_bytes``: device memory left
    beside it for activations and graphs (stated, not allocated); ``host_bytes``: host KV."""

    device_bytes: int
    host_bytes: int = 0
    headroom_bytes: int = 0

    def __post_init__(self):
        if self.device_bytes <= 0 or self.host_bytes < 0 or self.headroom_bytes < 0:
            raise ValueError(f"bad memory budget {self}")


# -- accounting a capacity tool can call (whole blocks, as the pool hands them out) --------
def blocks_for(count: int, per_block: int) -> int:
    return -(-count // per_block)


def session_kv_bytes(tokens: int, bytes_per_token: int, block_tokens: int) -> int:
    """Device bytes of a KV of ``tokens`` tokens; its host-tier copy takes the same."""
    return blocks_for(tokens, block_tokens) * block_tokens * bytes_per_token


def session_feature_bytes(
    image_tokens: int, hidden_size: int, element_size: int, bytes_per_block: int
) -> int:
    """Device bytes of one session's image features, stored in whole pool blocks."""
    elements_per_block = bytes_per_block // element_size
    return blocks_for(image_tokens * hidden_size, elements_per_block) * bytes_per_block


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
