"""make gpu-check: the engine on a GPU, step by step, each step's result kept as it ends.

    python3 -u -m scripts.gpu_check --out DIR [--device cpu] [--budgets table=300,...]
                                    [--steps preflight,attention,table,tests,shards,profile]
                                    [--sessions 8 32 64] [--new-tokens 64]

Runs from the repository root with the GPU machine's own Python (torch, transformers; no
boto3, moto or TorchServe; pytest only for ``tests``): no ``make setup``. Each step
(scripts/gpu/steps.py) runs in a process of its own under a time budget: an exception, a
crash or the budget ends that step (its stacks dumped) and the next one runs. As each step
ends, one flushed JSON line is appended to ``DIR/results.jsonl``::

    {"step", "ok", "seconds", "device", "torch", "error", "figures": {...}}

with the figures found up to where it ended (``error``: what ended it in its first line, then
the traceback or the step's last output); everything the steps print goes to the console
and ``DIR/gpu_check.log``. ``--device cpu`` runs every step's code on the CPU at a shrunk size
(the demo model, the 7B shape scaled down, graphs replayed eagerly). Without CUDA and without
``--device cpu`` it says so in one line and exits 0. Steps, their budgets and what each
measures: docs/testing.md §GPU check. Two more steps are not in a default run: ``compile``
(the decode step compiled whole), which scripts.gpu_probe runs before this check, and
``hf_generate`` (transformers' own generate against ours), which has a call of its own.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
# Seconds each step may take (GPU, CPU): 1.5 to 2.5 times what an H200 took
# (docs/testing.md §GPU check); together the GPU's stay under a 10-minute call.
BUDGETS = {
    "preflight": (60, 60),
    "attention": (60, 60),
    "table": (150, 120),
    "tests": (100, 60),
    "shards": (60, 60),
    "profile": (150, 90),
    # Not in a default run, whose budgets they would take past a 10-minute call:
    # scripts.gpu_probe runs compile; hf_generate has a call of its own
    # (docs/testing.md §On a lent GPU machine).
    "compile": (120, 120),
    "hf_generate": (170, 120),
}
DEFAULT_STEPS = tuple(step for step in BUDGETS if step not in ("compile", "hf_generate"))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / ".run" / "gpu-check")
    parser.add_argument("--steps", default=",".join(DEFAULT_STEPS))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--budgets", default="", help="step=seconds,... over the defaults")
    parser.add_argument("--sessions", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--shard-sessions", type=int, default=16)
    parser.add_argument("--run-step", help=argparse.SUPPRESS)  # a child: run this step alone
    parser.add_argument("--figures", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = names_from(parser, args.steps, BUDGETS, "step")
    return args


def names_from(parser: argparse.ArgumentParser, text: str, known, kind: str) -> list[str]:
    """A comma-separated list of ``kind`` names, each one of ``known`` (else the parser's
    error, which exits)."""
    names = [name for name in text.split(",") if name]
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"unknown {kind} {unknown[0]}; {kind}s: {', '.join(known)}")
    return names


def budgets(args: argparse.Namespace) -> dict[str, float]:
    column = 0 if args.device == "cuda" else 1
    chosen = {step: pair[column] for step, pair in BUDGETS.items()}
    for item in filter(None, args.budgets.split(",")):
        step, _, seconds = item.partition("=")
        if step not in chosen:
            raise SystemExit(f"gpu-check: --budgets names no step {step!r}")
        chosen[step] = float(seconds)
    return chosen


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.run_step:
        return run_step(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu-check: no CUDA device here (torch {torch.__version__}); nothing to check")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    limits = budgets(args)
    failed = []
    with open(args.out / "gpu_check.log", "a") as log, tempfile.TemporaryDirectory() as tmp:
        for step in args.steps:
            line = isolated(step, args, limits[step], Path(tmp) / f"{step}.json", log)
            with open(args.out / "results.jsonl", "a") as results:
                results.write(json.dumps(line) + "\n")
                results.flush()
                os.fsync(results.fileno())
            state = "ok" if line["ok"] else f"FAILED: {line['error'].splitlines()[0]}"
            say(log, f"== {step}: {state} in {line['seconds']} s; {json.dumps(line['figures'])}")
            if not line["ok"]:
                failed.append(step)
    print(f"gpu-check: {len(args.steps) - len(failed)} of {len(args.steps)} steps ok"
          + (f"; failed: {', '.join(failed)}" if failed else ""))  # fmt: skip
    return 1 if failed else 0


def say(log, text: str) -> None:
    print(text, flush=True)
    log.write(text + "\n")
    log.flush()


def error_line(error: BaseException) -> str:
    """An error in one line: its type and its message's first line (a failed compile's
    traceback ends in torch's "Set TORCHDYNAMO_VERBOSE=1 ...", whatever failed)."""
    return traceback.format_exception_only(error)[0].splitlines()[0][:300]


def isolated(step: str, args, budget: float, figures_path: Path, log) -> dict:
    """Run ``step`` in a child process with a time budget; its JSON line, from what the
    child wrote (figures as found, its outcome) or, if it died, from its last output."""
    say(log, f"== {step} (budget {budget:.0f} s)")
    command = [sys.executable, "-u", "-m", "scripts.gpu.check", "--run-step", step,
               "--figures", str(figures_path), "--device", args.device,
               "--budgets", f"{step}={budget}", "--new-tokens", str(args.new_tokens),
               "--shard-sessions", str(args.shard_sessions),
               "--sessions", *map(str, args.sessions)]  # fmt: skip
    start = time.perf_counter()
    child = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    tail: list[str] = []

    def relay() -> None:
        for text in child.stdout:
            say(log, text.rstrip("\n"))
            tail[:] = (tail + [text.rstrip("\n")])[-40:]

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    try:  # the child dumps its stacks and exits at its budget; this is the backstop
        child.wait(timeout=budget + 30)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
    reader.join(timeout=10)
    seconds = round(time.perf_counter() - start, 1)
    written = json.loads(figures_path.read_text()) if figures_path.exists() else {}
    outcome = written.pop("__outcome__", None)
    line = {"step": step, "ok": False, "seconds": seconds, "device": None,
            "torch": torch.__version__, "error": None, "figures": written}  # fmt: skip
    if outcome is not None:
        line.update(outcome)
    else:
        why = f"exit code {child.returncode}"
        if seconds >= budget:
            why = f"ran past its budget of {budget:.0f} s"
        line["error"] = "\n".join([f"step {step} ended: {why}; its last output:", *tail])
    return line


def run_step(args) -> int:
    """In the child: run one step, its figures written as found, its outcome last."""
    from scripts.gpu.steps import STEPS, Figures, Plan, device_name

    budget = budgets(args)[args.run_step]
    faulthandler.enable()  # a crash prints every thread's stack
    faulthandler.dump_traceback_later(max(budget - 5, 1), exit=True)  # then the parent's line
    plan = Plan.for_device(args.device, args)
    figures = Figures(args.figures)
    outcome = {"ok": True, "device": device_name(plan), "torch": torch.__version__, "error": None}
    try:
        STEPS[args.run_step](plan, figures)
    except Exception as error:
        traceback.print_exc()
        outcome.update(ok=False, error=f"{error_line(error)}\n{traceback.format_exc()[-4000:]}")
    faulthandler.cancel_dump_traceback_later()
    figures["__outcome__"] = outcome
    return 0 if outcome["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
