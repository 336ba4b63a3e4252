"""Generation parameters: parsed and bounded once, so the decode loop can trust them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from llava.errors import InvalidRequest, clip, echo

# Names accepted from the wire, with the aliases that OpenAI/TGI-style clients and the seeds'
# client (``max_new_token``) send.
_ALIASES = {"max_tokens": "max_new_tokens", "max_new_token": "max_new_tokens"}
_KNOWN = {
    "max_new_tokens",
    "min_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "do_sample",
    "seed",
    "stop",
}
MAX_STOPS, MAX_STOP_CHARS = 4, 256  # OpenAI's count; a bound on the text held back
# Sending any of these asks for sampling unless ``do_sample`` says otherwise, as OpenAI-style
# clients expect (they send ``temperature`` alone).
_SAMPLING = ("temperature", "top_p", "top_k")


@dataclass(frozen=True)
class GenerationParams:
    """``temperature == 0`` or ``do_sample == False`` means greedy decoding. On the wire,
    ``do_sample`` defaults to whether a sampling parameter was sent."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0  # eos is suppressed until this many ids were generated
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0, or at least the vocabulary (the sampler takes min(top_k, vocab)): no cut
    do_sample: bool = False
    seed: int | None = None
    stop: tuple[
        str, ...
    ] = ()  # the answer ends before the first of these (llava.sampling.stop_text)

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    @classmethod
    def from_mapping(
        cls,
        values: dict[str, Any] | None,
        *,
        default_max_new_tokens: int,
        max_new_tokens_limit: int,
    ) -> GenerationParams:
        """Validate client parameters; anything out of range is an InvalidRequest."""
        if values is None:
            values = {}
        if not isinstance(values, dict):
            raise InvalidRequest("'parameters' must be a JSON object")
        values = _canonical_names(values)
        unknown = sorted(set(values) - _KNOWN)
        if unknown:
            raise InvalidRequest(
                f"unknown generation parameters: {clip(', '.join(unknown))}; known: "
                f"{', '.join(sorted(_KNOWN))} (aliases: {', '.join(sorted(_ALIASES))})"
            )
        max_new = _int(values, "max_new_tokens", default_max_new_tokens, 1, max_new_tokens_limit)
        return cls(
            max_new_tokens=max_new,
            min_new_tokens=_int(values, "min_new_tokens", 0, 0, max_new),
            temperature=_float(values, "temperature", 1.0, 0.0, 100.0),
            top_p=_float(values, "top_p", 1.0, 1e-6, 1.0),
            top_k=_int(values, "top_k", 0, 0, 1_000_000),
            do_sample=_bool(values, "do_sample", any(name in values for name in _SAMPLING)),
            seed=_int(values, "seed", None, 0, 2**63 - 1),
            stop=_stops(values.get("stop", ())),
        )


def _canonical_names(values: dict[str, Any]) -> dict[str, Any]:
    canonical: dict[str, Any] = {}
    for name, value in values.items():
        key = _ALIASES.get(name, name)
        if key in canonical:
            raise InvalidRequest(f"'{name}' and another spelling of '{key}' were both sent")
        canonical[key] = value
    return canonical


def _int(values: dict, name: str, default, low: int, high: int):
    value = values.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"'{name}' must be an integer, got {echo(value)}")
    if not low <= value <= high:
        raise InvalidRequest(f"'{name}' must be between {low} and {high}, got {value}")
    return value


def _float(values: dict, name: str, default: float, low: float, high: float) -> float:
    value = values.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequest(f"'{name}' must be a finite number, got {echo(value)}")
    if not low <= value <= high:
        raise InvalidRequest(f"'{name}' must be between {low} and {high}, got {value}")
    return float(value)


def _bool(values: dict, name: str, default: bool) -> bool:
    value = values.get(name, default)
    if not isinstance(value, bool):
        raise InvalidRequest(f"'{name}' must be true or false, got {echo(value)}")
    return value


def _stops(value) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if (
        not isinstance(stops, list | tuple)
        or len(stops) > MAX_STOPS
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)
    ):
        raise InvalidRequest(
            f"'stop' must be a string or a list of at most {MAX_STOPS} strings of 1 to "
            f"{MAX_STOP_CHARS} characters, got {echo(value)}"
        )
    return tuple(stops)
