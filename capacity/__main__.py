"""How many sessions an instance holds, per memory tier (capacity.sizing does the arithmetic).

python -m capacity --model-dir DIR [--instance ml.g5.2xlarge | --gpu-memory 24GiB]
                   [--turns 10] [--tokens-per-turn 60] [--dtype float16]

A checkpoint the engine would refuse at start: its one-line reason on stderr, exit 1.
"""

from __future__ import annotations

import argparse
import sys

import torch

from capacity.instances import INSTANCES, GiB, Instance
from capacity.sizing import Workload, load_checkpoint, parse_size, report
from llava.config import EngineConfig, SettingsError
from llava.kv.budget import DEFAULT_HOST_FRACTION


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m capacity", description=__doc__.splitlines()[0])
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
    try:
        checkpoint = load_checkpoint(args.model_dir, getattr(torch, args.dtype))
    except SettingsError as e:  # UnsupportedCheckpoint: what the engine's start would fail with
        print(e, file=sys.stderr)
        return 1
    workload = Workload(args.turns, args.tokens_per_turn)
    print(report(checkpoint, workload, rows, args.host_fraction, EngineConfig(args.model_dir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
