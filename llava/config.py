"""Engine configuration: one frozen dataclass, built from a mapping (model-config.yaml, env)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

GiB = 1024**3
ENV_PREFIX = "LLAVA_"


@dataclass(frozen=True)
class EngineConfig:
    """What the engine needs to know; every field has a default that is safe to serve with.

    ``session_budget_bytes`` bounds the memory all sessions may hold (KV caches, image
    features, token histories). ``None`` means: on CUDA, ``session_budget_fraction`` of the
    device memory free after loading the model; on CPU, ``cpu_session_budget_bytes``.
    """

    model_dir: str
    device: str = "auto"  # "auto" → cuda if available, else cpu
    dtype: str = "auto"  # "auto" → float16 on cuda (bfloat16 where supported), float32 on cpu
    attn_implementation: str = "sdpa"
    session_ttl_s: float = 20 * 60
    session_budget_bytes: int | None = None
    session_budget_fraction: float = 0.8
    cpu_session_budget_bytes: int = 4 * GiB
    default_max_new_tokens: int = 128
    max_new_tokens_limit: int = 1024
    max_question_chars: int = 8000
    intake: dict[str, Any] = field(default_factory=dict)  # llava.intake.IntakePolicy keys

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> EngineConfig:
        """Build from a mapping; unknown keys are an error, not silently ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown engine config keys: {', '.join(unknown)}")
        return cls(**values)


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """Settings from ``LLAVA_<FIELD>`` variables (what a container's environment can set).

    Values are JSON where they parse (``LLAVA_SESSION_TTL_S=300``,
    ``LLAVA_INTAKE='{"allow": ["10.0.0.0/8"]}'``), plain strings otherwise (``LLAVA_DEVICE=cuda``).
    """
    overrides: dict[str, Any] = {}
    for f in dataclasses.fields(EngineConfig):
        raw = environ.get(ENV_PREFIX + f.name.upper())
        if raw is None:
            continue
        try:
            overrides[f.name] = json.loads(raw)
        except ValueError:
            overrides[f.name] = raw
    return overrides


def merge_settings(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``overrides`` win; the ``intake`` mapping is merged key by key, not replaced."""
    merged = {**base, **overrides}
    if "intake" in base and "intake" in overrides:
        merged["intake"] = {**base["intake"], **overrides["intake"]}
    return merged
