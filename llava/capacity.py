"""How many sessions an instance holds: bytes per session at each memory tier, by arithmetic.

    python -m llava.capacity --model-dir DIR [--instance ml.g5.2xlarge | --gpu-memory 24GiB]
                             [--turns 10] [--tokens-per-turn 60] [--dtype float16]

Reads the checkpoint's config.json, tokenizer and chat template only (no weights): the model is
built on PyTorch's meta device, so its parameter bytes are exact and nothing is allocated. The
per-session bytes come from the engine's own accounting: the KV pool's bytes per token and block
size (llava.kv_pool), a session's KV and features in whole pool blocks (llava.memory), the
opening prompt (llava.prompt) and the engine's budget rule (llava.engine)
(docs/design.md §Capacity by arithmetic).
Kept thin on purpose: each number is one call into the code that does the accounting.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoProcessor, LlavaConfig, LlavaForConditionalGeneration

from llava.config import EngineConfig
from llava.engine import DEFAULT_HOST_FRACTION, device_split
from llava.imageprep import image_aspect_ratio
from llava.kv_pool import BLOCK_TOKENS, kv_bytes_per_token
from llava.memory import session_feature_bytes, session_kv_bytes
from llava.prompt import ChatPrompt
from llava.runner import Runner

GiB, GB = 1024**3, 10**9


@dataclass(frozen=True)
class Instance:
    gpus: int
    gpu_memory_bytes: int  # per GPU
    host_memory_bytes: int
    source: str


_BATCH_GPU_TABLE = "AWS Batch User Guide, 'Run GPU jobs', instance table"
# SageMaker's ml.<type> runs on the EC2 instance of the same name. Figures as the source states
# them (GiB where it says GiB, GB where it says GB); the engine itself sizes from the memory
# the driver reports free after loading, which is somewhat less.
INSTANCES: dict[str, Instance] = {
    "ml.g5.xlarge": Instance(1, 24 * GiB, 16 * GiB, _BATCH_GPU_TABLE),
    "ml.g5.2xlarge": Instance(1, 24 * GiB, 32 * GiB, _BATCH_GPU_TABLE),
    "ml.g5.12xlarge": Instance(4, 24 * GiB, 192 * GiB, _BATCH_GPU_TABLE),
    "ml.g6.xlarge": Instance(1, 24 * GiB, 16 * GiB, _BATCH_GPU_TABLE),
    "ml.g6.2xlarge": Instance(1, 24 * GiB, 32 * GiB, _BATCH_GPU_TABLE),
    "ml.g6e.xlarge": Instance(
        1,
        48 * GB,
        32 * GiB,
        "NVIDIA L40S datasheet (48 GB GDDR6); host: 4 vCPU, 32 GiB "
        "(torchx named_resources_aws aws_g6e_xlarge; deploybase.ai 'L40S on AWS')",
    ),
    "ml.p4d.24xlarge": Instance(
        8,
        40 * GB,
        int(1.1 * 10**12),
        "AWS HPC blog 'Amazon EC2 P4d instances deep dive': 8 x 40 GB A100, 1.1 TB RAM",
    ),
}


@dataclass(frozen=True)
class Workload:
    turns: int = 10
    tokens_per_turn: int = 60  # question, template and answer tokens of one turn


@dataclass(frozen=True)
class SessionBytes:
    """One session's bytes, as the memory manager (llava.memory) counts them."""

    tokens: int
    kv: int  # whole pool blocks (device KV, or the same bytes held in host RAM)
    features: int  # image features in pool blocks (what a features-only session keeps)


@dataclass(frozen=True)
class Checkpoint:
    name: str
    dtype: torch.dtype
    weight_bytes: int
    opening_tokens: int  # BOS, template and image tokens prefilled at open
    kv_bytes_per_token: int
    feature_bytes: int
    refusal: str | None  # None: the engine runs it; else the message its start fails with


def load_checkpoint(model_dir: str, dtype: torch.dtype) -> Checkpoint:
    """The numbers capacity needs from ``model_dir``, without reading any weights."""
    config = LlavaConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = LlavaForConditionalGeneration(config).to(dtype)
    prompt = ChatPrompt(AutoProcessor.from_pretrained(model_dir))
    image_tokens = config.image_seq_length
    per_token = kv_bytes_per_token(config.text_config, dtype)
    return Checkpoint(
        name=Path(model_dir).name,
        dtype=dtype,
        weight_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
        opening_tokens=len(prompt.opening_ids(True, image_tokens)),
        kv_bytes_per_token=per_token,
        # (image tokens, hidden) in the model's dtype, stored in whole pool blocks
        feature_bytes=session_feature_bytes(
            image_tokens, config.text_config.hidden_size, dtype.itemsize, BLOCK_TOKENS * per_token
        ),
        refusal=refusal(model, prompt),
    )


def refusal(model, prompt: ChatPrompt) -> str | None:
    """What the engine's start would fail with (the checks llava.model and llava.runner run)."""
    try:
        Runner.check(model)
        image_aspect_ratio(model.config)
        prompt.check_stateful()
    except ValueError as e:
        return f"{type(e).__name__}: {e}"
    return None


def session_bytes(checkpoint: Checkpoint, workload: Workload) -> SessionBytes:
    tokens = checkpoint.opening_tokens + workload.turns * workload.tokens_per_turn
    return SessionBytes(
        tokens=tokens,
        kv=session_kv_bytes(tokens, checkpoint.kv_bytes_per_token, BLOCK_TOKENS),
        features=checkpoint.feature_bytes,
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
    (llava.shards). Each shard's device budget is the engine's rule (llava.engine.device_split
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
        f"checkpoint {checkpoint.name}: "
        + (
            "the engine runs it"
            if checkpoint.refusal is None
            else f"REFUSED at start: {checkpoint.refusal}"
        ),
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m llava.capacity", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model-dir", required=True, help="a llava-hf checkpoint directory")
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--instance",
        action="append",
        choices=sorted(INSTANCES),
        help="repeatable; default: every listed one",
    )
    where.add_argument("--gpu-memory", type=parse_size, help="one GPU of this size, e.g. 24GiB")
    parser.add_argument(
        "--host-memory",
        type=parse_size,
        default=32 * GiB,
        help="with --gpu-memory: the host's RAM (default 32GiB)",
    )
    parser.add_argument("--turns", type=int, default=Workload.turns)
    parser.add_argument("--tokens-per-turn", type=int, default=Workload.tokens_per_turn)
    parser.add_argument(
        "--dtype",
        choices=("float16", "bfloat16", "float32"),
        default="float16",
        help="2 bytes for float16 and bfloat16 (what dtype=auto picks on a GPU)",
    )
    parser.add_argument(
        "--host-fraction",
        type=float,
        default=DEFAULT_HOST_FRACTION,
        help="share of host RAM for the host KV tier (default: the engine's, when"
        " host_budget_bytes is unset; of the RAM free at start, which is somewhat less)",
    )
    args = parser.parse_args(argv)
    if args.turns < 0 or args.tokens_per_turn < 0:
        parser.error("--turns and --tokens-per-turn must be >= 0")
    if not 0 < args.host_fraction <= 1:
        parser.error("--host-fraction must be in (0, 1]")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.gpu_memory:
        rows = {"(given)": Instance(1, args.gpu_memory, args.host_memory, "--gpu-memory")}
    elif args.instance:
        rows = {name: INSTANCES[name] for name in args.instance}
    else:
        rows = INSTANCES
    checkpoint = load_checkpoint(args.model_dir, getattr(torch, args.dtype))
    workload = Workload(args.turns, args.tokens_per_turn)
    print(report(checkpoint, workload, rows, args.host_fraction, EngineConfig(args.model_dir)))
    return 0 if checkpoint.refusal is None else 1


if __name__ == "__main__":
    sys.exit(main())
