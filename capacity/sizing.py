"""How many sessions an instance holds: bytes per session at each memory tier, by arithmetic.

Reads the checkpoint's config.json, tokenizer, processor and chat template only (no weights),
through the engine's own start checks (llava.model.checkpoint.inspect_checkpoint: a checkpoint
the engine refuses raises UnsupportedCheckpoint, one line); the model is built on PyTorch's meta
device, so its parameter bytes are exact and nothing is allocated. A session's image tokens are
the most any image gets (llava.model.vision.most_image_tokens: LLaVA-NeXT's count depends on the
image's size), so the per-session bytes are the worst case. They come from the engine's own
accounting: the KV pool's bytes per token (GQA's KV heads included) and block size
(llava.kv.pool), a session's KV and features in whole pool blocks (llava.kv.memory), the opening
prompt (llava.model.prompt) and the engine's budget rule (llava.kv.budget)
(docs/deploy.md §Capacity by arithmetic). A turn that sends an image adds that image's
features and its tokens' KV to the session (``image_bytes``; at most ``max_images_per_session``
images a session).
Kept thin on purpose: each number is one call into the code that does the accounting.
"""

from __future__ import annotations

import argparse
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from capacity.instances import GB, GiB, Instance
from llava.config import EngineConfig
from llava.kv.budget import device_split, session_feature_bytes, session_kv_bytes
from llava.kv.pool import BLOCK_TOKENS, kv_bytes_per_token
from llava.model.checkpoint import inspect_checkpoint
from llava.model.vision import most_image_tokens
from llava.sessions.persist import Snapshot, entry_bytes


@dataclass(frozen=True)
class Workload:
    turns: int = 10
    tokens_per_turn: int = 60  # question, template and answer tokens of one turn


@dataclass(frozen=True)
class SessionBytes:
    """One session's bytes, as the memory manager (llava.kv.memory) counts them."""

    tokens: int
    kv: int  # whole pool blocks (device KV, or the same bytes held in host RAM)
    features: int  # image features in pool blocks (what a features-only session keeps)
    persisted: int  # its persistent-tier entry on disk (features and history)


@dataclass(frozen=True)
class Checkpoint:
    name: str
    family: str  # config.json's model_type: "llava" (1.5) or "llava_next"
    dtype: torch.dtype
    weight_bytes: int
    image_tokens: int  # the most any image gets: a session's worst case
    opening_tokens: int  # BOS, template and image tokens prefilled at open
    kv_bytes_per_token: int
    feature_bytes: int
    feature_shape: tuple[int, int]  # (image tokens, hidden): the persistent tier's copy


def load_checkpoint(model_dir: str, dtype: torch.dtype) -> Checkpoint:
    """The numbers capacity needs from ``model_dir``, without reading any weights. Raises
    llava.model.checkpoint.UnsupportedCheckpoint (one line) where the engine's start would."""
    inspected = inspect_checkpoint(model_dir)
    with torch.device("meta"):
        model = inspected.model_class(inspected.config).to(dtype)
    text_config = inspected.config.text_config
    image_tokens = most_image_tokens(inspected.processor)
    per_token = kv_bytes_per_token(text_config, dtype)
    return Checkpoint(
        name=Path(model_dir).name,
        family=inspected.family,
        dtype=dtype,
        weight_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
        image_tokens=image_tokens,
        opening_tokens=len(inspected.prompt.opening_ids(True, image_tokens)),
        kv_bytes_per_token=per_token,
        # (image tokens, hidden) in the model's dtype, stored in whole pool blocks
        feature_bytes=session_feature_bytes(
            image_tokens, text_config.hidden_size, dtype.itemsize, BLOCK_TOKENS * per_token
        ),
        feature_shape=(image_tokens, text_config.hidden_size),
    )


@dataclass(frozen=True)
class ImageBytes:
    """What one more image costs a session on the device (a turn's ``image``): the largest
    image's, as for the open's."""

    tokens: int  # its image tokens
    raw_features: int  # tokens x hidden size x the dtype's bytes
    features: int  # the same in whole pool blocks (llava.kv.features keeps them so)
    kv: int  # its tokens' K and V in every layer

    @property
    def total(self) -> int:
        return self.features + self.kv


def image_bytes(checkpoint: Checkpoint) -> ImageBytes:
    """Device bytes of one extra image in a session: its features (one copy per image, in
    pool blocks) and the KV of its image tokens, which the turn prefills into the session."""
    tokens, hidden = checkpoint.feature_shape
    return ImageBytes(
        tokens=tokens,
        raw_features=tokens * hidden * checkpoint.dtype.itemsize,
        features=checkpoint.feature_bytes,
        kv=tokens * checkpoint.kv_bytes_per_token,
    )


# The persistent tier's copy of the conversation's text, in characters a token (English).
CHARS_PER_TOKEN = 4


def session_bytes(checkpoint: Checkpoint, workload: Workload) -> SessionBytes:
    tokens = checkpoint.opening_tokens + workload.turns * workload.tokens_per_turn
    # the entry as llava.sessions.persist writes it: ids of 5 digits, the turns' text
    text = "x" * (CHARS_PER_TOKEN * workload.turns * workload.tokens_per_turn)
    history = Snapshot(
        str(uuid.uuid4()),
        [29_999] * tokens,
        [{"role": "user", "content": text}],
        workload.turns,
        last_used_wall=1.8e9,
        ttl_s=1200.0,
        images=(("0" * 64, checkpoint.image_tokens),),  # the open's image
        opening_images=1,
    )
    return SessionBytes(
        tokens=tokens,
        kv=session_kv_bytes(tokens, checkpoint.kv_bytes_per_token, BLOCK_TOKENS),
        features=checkpoint.feature_bytes,
        persisted=entry_bytes(history, checkpoint.feature_shape, checkpoint.dtype.itemsize),
    )


@dataclass(frozen=True)
class Fit:
    device_budget: int  # what one shard's memory manager may hold on its GPU
    host_budget: int  # the instance's host tier, split evenly across the shards
    device_kv: int  # sessions that fit, all hot (KV + features on the GPUs)
    host_kv: int  # all with KV in host RAM (features stay on the GPUs)
    features_only: int  # all demoted to features (next turn re-prefills)


def fit(
    checkpoint: Checkpoint,
    per_session: SessionBytes,
    gpu_bytes: int,
    host_bytes: int,
    config: EngineConfig,
    shards: int = 1,
) -> Fit:
    """Sessions per instance of ``shards`` engine shards, one per GPU of ``gpu_bytes``
    (llava.shards). Each shard's device budget is the engine's rule (llava.kv.budget.device_split
    of the memory free after loading), with "free" taken as GPU memory minus the weights; each
    gets ``host_bytes // shards`` of the host tier, as ShardedEngine.from_config splits it."""
    device = max(0, device_split(config, gpu_bytes - checkpoint.weight_bytes)[0])
    hot = per_session.kv + per_session.features
    host_per_shard = host_bytes // shards
    return Fit(
        device_budget=device,
        host_budget=host_bytes,
        device_kv=shards * (device // hot),
        host_kv=shards * min(host_per_shard // per_session.kv, device // per_session.features),
        features_only=shards * (device // per_session.features),
    )


_SIZE = re.compile(r"([\d.]+)\s*(GiB|GB|MiB|MB)?", re.IGNORECASE)
_UNITS = {"gib": GiB, "gb": GB, "mib": 1024**2, "mb": 10**6, None: 1}


def parse_size(text: str) -> int:
    """``24GiB``, ``48GB``, ``512MiB`` or plain bytes."""
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 24GiB, 48GB)")
    unit = match[2].lower() if match[2] else None
    return int(float(match[1]) * _UNITS[unit])


def _gib(n: int) -> str:
    return f"{n / GiB:,.2f} GiB"


def persistent_tier_lines(per: SessionBytes, config: EngineConfig) -> list[str]:
    """Sessions the persistent tier keeps (parked or across a restart) at the caps a start
    may measure (llava.sessions.persist.persistence: half the directory's file system)."""
    floor = config.persist_min_bytes
    caps = [
        ("Docker's default /dev/shm (64 MB), were it used", 32 * 10**6),
        (
            f"the persist_min_bytes floor ({_mib(floor)}): a smaller /dev/shm gives way to"
            " persist_fallback_dir",
            floor,
        ),  # fmt: skip
    ]
    shm = Path("/dev/shm")
    if shm.is_dir():
        caps.append(("this machine's /dev/shm", shutil.disk_usage(shm).total // 2))
    return [f"    {cap // per.persisted:>9,} sessions in {_mib(cap)}: {what}" for what, cap in caps]


def extra_image_lines(checkpoint: Checkpoint, config: EngineConfig) -> list[str]:
    """Bytes of each image a turn adds, and of a session holding the most images."""
    image = image_bytes(checkpoint)
    more = config.max_images_per_session - 1
    return [
        f"each extra image (a turn's image): {image.tokens:,} tokens ({_image_count(checkpoint)}):"
        f" features {_mib(image.raw_features)} ({_mib(image.features)} in pool blocks)"
        f" + KV {_mib(image.kv)} = {_mib(image.total)} on the GPU",
        f"  at most {config.max_images_per_session} images a session (max_images_per_session,"
        f" the open's included): {more} more add {_mib(more * image.total)}",
    ]


def _image_count(checkpoint: Checkpoint) -> str:
    if checkpoint.family == "llava_next":
        return "the largest image; NeXT counts depend on the image size"
    return "the same for every image"


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def report(
    checkpoint: Checkpoint,
    workload: Workload,
    rows: dict[str, Instance],
    host_fraction: float,
    config: EngineConfig,
) -> str:
    per = session_bytes(checkpoint, workload)
    lines = [
        f"checkpoint {checkpoint.name} ({checkpoint.family}): the engine runs it",
        f"image tokens per session: {checkpoint.image_tokens:,} ({_image_count(checkpoint)})",
        f"weights {_gib(checkpoint.weight_bytes)} in {str(checkpoint.dtype).removeprefix('torch.')}"
        f"; KV {checkpoint.kv_bytes_per_token / 2**10:,.0f} KiB per token"
        f" (pool blocks of {BLOCK_TOKENS} tokens)",
        f"session: {checkpoint.opening_tokens} opening tokens (image included)"
        f" + {workload.turns} turns x {workload.tokens_per_turn} = {per.tokens} tokens",
        f"  device KV tier : {_mib(per.kv + per.features)} on the GPU"
        f" (KV {_mib(per.kv)} + features {_mib(per.features)})",
        f"  host KV tier   : {_mib(per.kv)} in host RAM + {_mib(per.features)} on the GPU",
        f"  features only  : {_mib(per.features)} on the GPU (next turn re-prefills"
        f" {per.tokens} tokens)",
        f"  parked         : {_mib(per.persisted)} in the persistent tier's directory, nothing"
        f" in memory (text at {CHARS_PER_TOKEN} characters a token)",
        *persistent_tier_lines(per, config),
        *extra_image_lines(checkpoint, config),
        "",
        f"sessions per instance (one worker, one engine shard per GPU; device budget per GPU"
        f" {config.session_budget_fraction:g} x (GPU memory - weights); host tier budget"
        f" {host_fraction:g} x host RAM, split across the shards)",
        f"{'instance':<17} {'GPUs':>4} {'GPU mem':>10} {'host RAM':>11} {'budget/GPU':>10}"
        f" {'device KV':>9} {'host KV':>8} {'features':>9}",
    ]
    for name, instance in rows.items():
        if instance.gpu_memory_bytes <= checkpoint.weight_bytes:
            lines.append(f"{name:<17} the weights do not fit in {_gib(instance.gpu_memory_bytes)}")
            continue
        host = int(instance.host_memory_bytes * host_fraction)
        f = fit(checkpoint, per, instance.gpu_memory_bytes, host, config, instance.gpus)
        lines.append(
            f"{name:<17} {instance.gpus:>4} {_gib(instance.gpu_memory_bytes):>10}"
            f" {_gib(instance.host_memory_bytes):>11} {_gib(f.device_budget):>10}"
            f" {f.device_kv:>9,} {f.host_kv:>8,} {f.features_only:>9,}"
        )
    sources = sorted({i.source for i in rows.values()})
    lines += ["", "instance figures: " + "; ".join(sources)]
    return "\n".join(lines)
