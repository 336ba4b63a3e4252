"""Engine configuration: one frozen dataclass, checked when it is built.

Settings come from ``handler:`` in model-config.yaml (archived into the .mar) and from
``LLAVA_<FIELD>`` environment variables, which win. Every value is checked (type and range)
when the config is built, so a bad one fails the worker's start with one line that names the
variable to fix (:class:`SettingsError`), instead of surfacing on the first request.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

GiB = 1024**3
# the values of ``attention`` (llava.exec.runner.Runner)
ATTENTION = ("auto", "flex", "triton", "sdpa")
# the values of ``prefix_sharing`` (llava.sched.work.RequestContext.prefix_keys)
PREFIX_SHARING = ("opening", "all", "off")
ENV_PREFIX = "LLAVA_"
ARCHIVED = "model-config.yaml handler."  # how an archived setting is named in messages
logger = logging.getLogger(__name__)


class SettingsError(ValueError):
    """A bad setting. ``str()`` is one line naming where it came from and what it must be."""

    def __init__(self, setting: str, problem: str, source: str | None = None):
        self.setting, self.problem, self.source = setting, problem, source or setting
        super().__init__(f"bad setting {self.source}: {problem}")

    def from_source(self, source: str) -> SettingsError:
        return SettingsError(self.setting, self.problem, source)


@dataclass(frozen=True)
class EngineConfig:
    """What the engine needs to know; every field has a default that is safe to serve with.

    ``session_budget_bytes`` bounds the device memory all sessions may hold (KV caches and
    image features: the KV pool, allocated at start). ``None`` means: on CUDA, what is free
    after loading the model less ``device_headroom_bytes``; on CPU, ``cpu_session_budget_bytes``.
    ``device_headroom_bytes`` is left free for activations and graphs (``None``: on CUDA
    ``1 - session_budget_fraction`` of the free memory, on CPU 0). ``host_budget_bytes``
    bounds the host copies of KV caches moved off the device (``None``: a quarter of the
    host's free memory; 0: no host tier). See docs/engine/memory.md §Memory policy.
    """

    model_dir: str
    # One engine shard per listed device ("cuda:0,cuda:1"; "cpu,cpu" runs two on the CPU);
    # "auto" → every visible GPU, else the CPU alone (docs/engine/scheduling.md §Engine shards).
    device: str = "auto"
    dtype: str = "auto"  # "auto" → float16 on cuda (bfloat16 where supported), float32 on cpu
    attn_implementation: str = "sdpa"
    # The step runner's decode attention (llava.exec.runner.Runner): "flex" (one paged
    # flex_attention call per layer), "triton" (the project's split-K paged kernel: CUDA, or CPU
    # under TRITON_INTERPRET=1), "sdpa" (one SDPA per sequence), or "auto": on CUDA the faster
    # of flex and triton timed at warm-up, sdpa on CPU, and sdpa for good if the paged call
    # fails (docs/engine/execution.md §Step runner).
    attention: str = "auto"
    # capture decode graphs on CUDA (docs/engine/execution.md §Decode graphs)
    cuda_graphs: bool = True
    session_ttl_s: float = 20 * 60
    session_budget_bytes: int | None = None
    session_budget_fraction: float = 0.8
    cpu_session_budget_bytes: int = 4 * GiB
    device_headroom_bytes: int | None = None
    host_budget_bytes: int | None = None
    persist_dir: str | None = None
    persist_max_bytes: int | None = None
    # A persist_dir whose measured cap is under persist_min_bytes gives way to
    # persist_fallback_dir (docs/engine/sessions.md §Persistent tier).
    persist_min_bytes: int = 1 * GiB
    persist_fallback_dir: str | None = None
    # The durable store behind the persistent tier, so a session outlives its instance
    # (docs/engine/sessions.md §Durable store): "s3://bucket/prefix", an absolute directory
    # (a shared file system), or None (off). Its S3 writes are encrypted with this KMS key
    # (None: S3's own keys); a worker told to stop flushes its pending writes for at most
    # durable_flush_s (SageMaker kills the container 30 s after SIGTERM).
    durable_store: str | None = None
    durable_store_kms_key: str | None = None
    durable_flush_s: float = 20.0
    # The scheduler (docs/engine/scheduling.md §Mixed or alternating steps): sequences per step
    # (1: one request at a time), prefill ids fed per step across the prefilling requests, and
    # whether a step mixes decode rows with prefill chunks (false: the two kinds alternate).
    max_batch: int = 32
    prefill_chunk_tokens: int = 512
    mixed_steps: bool = True
    # How long a turn short of device memory waits for running turns (their KV turns idle and
    # movable as they end) before idle sessions are dropped or parked for it
    # (docs/engine/memory.md §Memory policy).
    wait_for_room_s: float = 0.25
    check_memory_when_idle: bool = False  # debug: the engine loop checks the books when idle
    default_max_new_tokens: int = 128
    max_new_tokens_limit: int = 1024
    max_question_chars: int = 8000
    # Every session's system prompt unless its open sends its own "system" (docs/wire.md).
    system_prompt: str = ""
    max_system_chars: int = 8000
    # What sessions reuse of the KV blocks and image features others computed
    # (docs/engine/memory.md §Shared prefixes): "opening" (the image and the operator's
    # system_prompt, never a caller's text), "all" (every block: one trusted caller), "off".
    prefix_sharing: str = "opening"
    # Every turn ends by then (stop_reason "deadline"): below SageMaker's 60 s invocation limit.
    turn_deadline_s: float = 50.0
    # Admission limits (docs/security.md §Admission limits). Sessions held at once: one more
    # evicts the least recently used text-only idle session, else is refused (NO_CAPACITY).
    max_sessions: int = 1024
    # A session's conversation in tokens (image, prompt, every turn and answer): a turn that
    # would pass it is refused (CONVERSATION_TOO_LONG); the context length bounds it too.
    max_session_tokens: int = 8192
    # Images a session holds (its open's and those its turns bring); one more is refused
    # (TOO_MANY_IMAGES). Each costs its features and its tokens' KV (docs/settings.md).
    max_images_per_session: int = 4
    # Asks of one session waiting behind the one in flight; one more is refused (SESSION_BUSY).
    # One, so that the ask a caller sends right after hanging up on a stream waits for the
    # stopped turn to end instead of racing its CANCEL_TURN.
    max_waiting_asks: int = 1
    # Requests a worker serves at once; one more is refused before it takes a thread
    # (503 OVERLOADED with Retry-After).
    max_requests_in_flight: int = 64
    # Threads that fetch and decode images, apart from the request threads.
    image_workers: int = 2
    intake: dict[str, Any] = field(default_factory=dict)  # llava.intake.IntakePolicy keys

    def __post_init__(self):
        for f in dataclasses.fields(self):
            check, must_be = CHECKS[f.name]
            value = getattr(self, f.name)
            if not check(value):
                raise SettingsError(f.name, f"{value!r} is not {must_be}")
        if len(self.system_prompt) > self.max_system_chars:
            raise SettingsError(
                "system_prompt",
                f"{len(self.system_prompt)} characters, over max_system_chars "
                f"({self.max_system_chars})",
            )
        if self.default_max_new_tokens > self.max_new_tokens_limit:
            raise SettingsError(
                "default_max_new_tokens",
                f"{self.default_max_new_tokens} is over max_new_tokens_limit "
                f"({self.max_new_tokens_limit})",
            )
        if self.durable_store is not None and self.persist_dir is None:
            problem = "needs the persistent tier (persist_dir): a resumed session is kept there"
            raise SettingsError("durable_store", problem)
        from llava.intake.policy import IntakePolicy  # the policy owns its keys and ranges

        try:
            IntakePolicy.from_mapping(self.intake)
        except (TypeError, ValueError) as e:
            raise SettingsError("intake", str(e)) from None

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> EngineConfig:
        """Build from a mapping; unknown keys are an error, not silently ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise SettingsError(unknown[0], f"unknown setting; known: {', '.join(sorted(known))}")
        return cls(**values)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return _int(value) or isinstance(value, float)


def _positive_int(value: Any) -> bool:
    return _int(value) and value > 0


def _one_of(*choices: str) -> tuple[Callable[[Any], bool], str]:
    return (lambda value: value in choices), f"one of {', '.join(choices)}"


# S3's bucket names (3-63 lowercase letters, digits, dots, hyphens) and a prefix of safe key
# characters; or an absolute path.
_DURABLE_STORE = re.compile(r"s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[A-Za-z0-9!_.*'()/-]*)?|/.*")
_KMS_KEY = re.compile(r"[A-Za-z0-9:/_.-]{1,2048}")
_DEVICE = re.compile(r"auto|(cpu|cuda(:\d+)?)(,(cpu|cuda(:\d+)?))*")

# field → (check, what the value must be): one entry per EngineConfig field.
CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "model_dir": (lambda v: isinstance(v, str) and bool(v), "a directory path"),
    "device": (
        lambda v: isinstance(v, str) and bool(_DEVICE.fullmatch(v)),
        "auto, or a comma-separated list of cpu, cuda and cuda:<index> (one shard each)",
    ),
    "dtype": _one_of("auto", "float32", "float16", "bfloat16"),
    "attn_implementation": _one_of("sdpa", "eager", "flash_attention_2"),
    "attention": _one_of(*ATTENTION),
    "cuda_graphs": (lambda v: isinstance(v, bool), "true or false"),
    "session_ttl_s": (lambda v: _number(v) and v > 0, "a number of seconds > 0"),
    "session_budget_bytes": (
        lambda v: v is None or _positive_int(v),
        "null (sized from the device) or an integer > 0",
    ),
    "session_budget_fraction": (lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "cpu_session_budget_bytes": (_positive_int, "an integer > 0"),
    "device_headroom_bytes": (
        lambda v: v is None or (_int(v) and v >= 0),
        "null (what session_budget_fraction leaves) or an integer >= 0",
    ),
    "host_budget_bytes": (
        lambda v: v is None or (_int(v) and v >= 0),
        "null (a quarter of the host's free memory) or an integer >= 0 (0: no host tier)",
    ),
    "persist_dir": (
        lambda v: v is None or (isinstance(v, str) and os.path.isabs(v)),
        "null (no persistent tier) or an absolute directory path",
    ),
    "persist_max_bytes": (
        lambda v: v is None or _positive_int(v),
        "null (half the directory's file system) or an integer > 0",
    ),
    "persist_min_bytes": (lambda v: _int(v) and v >= 0, "an integer >= 0"),
    "persist_fallback_dir": (
        lambda v: v is None or (isinstance(v, str) and os.path.isabs(v)),
        "null (none) or an absolute directory path",
    ),
    "durable_store": (
        lambda v: v is None or (isinstance(v, str) and bool(_DURABLE_STORE.fullmatch(v))),
        "null (off), s3://<bucket>/<prefix> or an absolute directory path",
    ),
    "durable_store_kms_key": (
        lambda v: v is None or (isinstance(v, str) and bool(_KMS_KEY.fullmatch(v))),
        "null (S3's own keys) or a KMS key id, alias or ARN",
    ),
    "durable_flush_s": (lambda v: _number(v) and 0 < v <= 30, "a number of seconds in (0, 30]"),
    "max_batch": (_positive_int, "an integer > 0"),
    "prefill_chunk_tokens": (_positive_int, "an integer > 0"),
    "mixed_steps": (lambda v: isinstance(v, bool), "true or false"),
    "wait_for_room_s": (
        lambda v: _number(v) and 0 <= v <= 10,
        "a number of seconds from 0 to 10",
    ),
    "check_memory_when_idle": (lambda v: isinstance(v, bool), "true or false"),
    "default_max_new_tokens": (_positive_int, "an integer > 0"),
    "max_new_tokens_limit": (_positive_int, "an integer > 0"),
    "max_question_chars": (_positive_int, "an integer > 0"),
    "system_prompt": (lambda v: isinstance(v, str), "a string (empty: no system prompt)"),
    "max_system_chars": (_positive_int, "an integer > 0"),
    "prefix_sharing": _one_of(*PREFIX_SHARING),
    "turn_deadline_s": (
        lambda v: _number(v) and 0 < v < 60,
        "a number of seconds > 0 and < 60 (SageMaker's invocation limit)",
    ),
    "max_sessions": (_positive_int, "an integer > 0"),
    "max_session_tokens": (_positive_int, "an integer > 0"),
    "max_images_per_session": (_positive_int, "an integer > 0"),
    "max_waiting_asks": (lambda v: _int(v) and 0 <= v <= 16, "an integer from 0 to 16"),
    "max_requests_in_flight": (_positive_int, "an integer > 0"),
    "image_workers": (lambda v: _int(v) and 1 <= v <= 32, "an integer from 1 to 32"),
    "intake": (lambda v: isinstance(v, Mapping), "a JSON object of intake settings"),
}


def env_name(setting: str) -> str:
    return ENV_PREFIX + setting.upper()


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """Settings from ``LLAVA_<FIELD>`` variables (what a container's environment can set).

    Values are JSON where they parse (``LLAVA_SESSION_TTL_S=300``,
    ``LLAVA_INTAKE='{"allow": ["10.0.0.0/8"]}'``), plain strings otherwise (``LLAVA_DEVICE=cuda``).
    """
    overrides: dict[str, Any] = {}
    for f in dataclasses.fields(EngineConfig):
        raw = environ.get(env_name(f.name))
        if raw is None:
            continue
        try:
            overrides[f.name] = json.loads(raw)
        except ValueError:
            overrides[f.name] = raw
    return overrides


# Variables of the seed documents' containers, read where their meaning is plain:
# name → (setting, factor to the setting's unit, the name's unit) (docs/settings.md §Settings).
SEED_NAMES: dict[str, tuple[str, float, str]] = {"SES_TTL_MIN": ("session_ttl_s", 60, "minutes")}


def seed_overrides(environ: Mapping[str, str]) -> dict[str, tuple[str, Any]]:
    """setting → (variable, value) from the seeds' names; a name that disagrees with our own
    ``LLAVA_*`` variable for the same setting fails in one line (which one wins is not a guess)."""
    found: dict[str, tuple[str, Any]] = {}
    for name, (setting, factor, unit) in SEED_NAMES.items():
        raw = environ.get(name)
        if raw is None:
            continue
        try:
            value = float(raw) * factor
        except ValueError:
            raise SettingsError(setting, f"{raw!r} is not a number of {unit}", name) from None
        ours = env_name(setting)
        if ours in environ and env_overrides({ours: environ[ours]}).get(setting) != value:
            raise SettingsError(
                setting,
                f"{name}={raw} ({unit}, {value:g} s) conflicts with {ours}={environ[ours]}; "
                "set only one",
                name,
            )
        found[setting] = (name, value)
    return found


def unknown_env_names(environ: Mapping[str, str]) -> list[str]:
    """``LLAVA_*`` variables that name no setting (a misspelt one would be silently ignored)."""
    known = {env_name(f.name) for f in dataclasses.fields(EngineConfig)}
    return sorted(n for n in environ if n.startswith(ENV_PREFIX) and n not in known)


def merge_settings(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``overrides`` win; the ``intake`` mapping is merged key by key, not replaced."""
    merged = {**base, **overrides}
    intakes = base.get("intake"), overrides.get("intake")
    if all(isinstance(i, Mapping) for i in intakes):
        merged["intake"] = {**intakes[0], **intakes[1]}
    return merged


def load_config(
    archived: Mapping[str, Any], environ: Mapping[str, str], base_dir: str
) -> EngineConfig:
    """The config a worker serves with: archived settings, overridden by the environment.

    A relative ``model_dir`` names a folder under ``base_dir`` (inside the extracted .mar).
    The seeds' names (``SES_TTL_MIN``, :data:`SEED_NAMES`) count as environment settings.
    Raises :class:`SettingsError` naming the variable (``LLAVA_SESSION_TTL_S``) or the
    archived key (``model-config.yaml handler.session_ttl_s``) that holds the bad value.
    Unknown ``LLAVA_*`` names are logged as warnings.
    """
    for name in unknown_env_names(environ):
        logger.warning("ignoring %s: no such setting (settings are LLAVA_<FIELD>)", name)
    if not isinstance(archived, Mapping):
        raise SettingsError("handler", f"must be a mapping, got {archived!r}", ARCHIVED[:-1])
    seeds = seed_overrides(environ)
    overrides = {setting: value for setting, (_name, value) in seeds.items()}
    overrides |= env_overrides(environ)
    settings = merge_settings(archived, overrides)
    model_dir = settings.get("model_dir", ".")
    if isinstance(model_dir, str):
        settings["model_dir"] = os.path.join(base_dir, model_dir)
    try:
        return EngineConfig.from_mapping(settings)
    except SettingsError as e:
        raise e.from_source(setting_source(e.setting, environ)) from None


def setting_source(setting: str, environ: Mapping[str, str]) -> str:
    """Where a setting's value came from, as a message should name it: our ``LLAVA_*``
    variable, else a seed name that set it (:data:`SEED_NAMES`), else the archived key."""
    if env_name(setting) in environ:
        return env_name(setting)
    seeds = [name for name, (target, _f, _u) in SEED_NAMES.items() if target == setting]
    return next((name for name in seeds if name in environ), ARCHIVED + setting)
