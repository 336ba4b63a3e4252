"""The figures the GPU issue's changes rest on, each measured alone on the lent GPU before
``scripts.gpu_check`` runs (docs/testing.md §GPU check).

    python3 -u -m scripts.gpu_probe --out DIR [--device cpu] [--probes copies,...] [--budget S]

Probes, in the order they run (bf16 on CUDA; fp32 at tiny shapes with ``--device cpu``, which
proves each code path in about a minute rather than timing it):

- ``copies``: host↔device copies of 1 GiB from and into pinned, pageable and a non-contiguous
  slice of pinned memory (a 2,000-token session's runs in the pool's layout), GB/s;
- ``sdpa_prefill``: a turn's prefill attention as the engine ran it (3-D q/k/v and a boolean
  causal mask) against 4-D q/k/v with ``causal_lower_right``, and which SDPA backends take each;
- ``gemms``: q/k/v as three GEMMs against one merged QKV GEMM, gate and up against one merged;
- ``paged_decode``: one layer's paged decode attention over a production-sized pool: flex with
  the full-block mask and with partial blocks only, at each ``SPLIT_KV``, and the in-project
  Triton kernel at a few splits, each against SDPA over the same slots;
- ``step_compile``: the served decode step compiled whole by inductor, in a process of its
  own under its own time limit (``scripts.gpu.steps.whole_step_compile``).

Every figure is one JSON line appended to ``DIR/probe.jsonl`` (flushed, so a run cut short
keeps what it found)::

    {"probe", "device", "torch", "dtype", "seconds", <what was measured>...,
     <figures>... | "error" | "skipped"}

A case that raises costs its own line (its error in one line there, the whole traceback on
the console) and the next one runs; past ``--budget`` seconds each probe left writes one line
that says it was skipped, but ``step_compile``, whose limit is held back from the budget.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from scripts.gpu.check import error_line, isolated, names_from
from scripts.gpu.steps import GiB, MiB, Plan, device_name, sync

# The budget of a whole run, and the part held back for ``step_compile`` (seconds; GPU, CPU).
BUDGET_S = {"cuda": 290, "cpu": 240}
COMPILE_LIMIT_S = {"cuda": 120, "cpu": 120}
# Calls captured in one CUDA graph to time a kernel: one replay's launch is shared by them.
GRAPH_CALLS = 10


@dataclass(frozen=True)
class Shapes:
    """What the probes measure: llava-1.5-7b's shapes on the GPU, tiny ones on the CPU."""

    copy_bytes: int
    copy_runs: int  # contiguous runs of the non-contiguous pinned slice
    heads: int  # query heads = KV heads (llava-1.5-7b has no GQA)
    head_dim: int
    block_tokens: int
    pool_slots: int
    decode_rows: tuple[int, ...]
    decode_tokens: tuple[int, ...]
    split_kv: tuple[int, ...]  # flex's SPLIT_KV values swept with partial-only masks
    triton_splits: tuple[int, ...]
    prefills: tuple[tuple[int, int], ...]  # (new tokens, total tokens)
    hidden: int
    intermediate: int
    gemm_rows: tuple[int, ...]
    reps: int  # timed repetitions after the warm-up


GPU_SHAPES = Shapes(
    copy_bytes=GiB, copy_runs=2048, heads=32, head_dim=128, block_tokens=16,
    pool_slots=204_800, decode_rows=(1, 8, 32), decode_tokens=(650, 2000),
    split_kv=(1, 2, 4, 8, 16, 32), triton_splits=(1, 4, 16),
    prefills=((17, 1100), (512, 2009)), hidden=4096, intermediate=11008, gemm_rows=(1, 32),
    reps=7,
)  # fmt: skip
# Triton's interpreter runs a kernel in Python: the CPU's Triton shapes stay this small.
CPU_SHAPES = Shapes(
    copy_bytes=4 * MiB, copy_runs=64, heads=2, head_dim=16, block_tokens=16, pool_slots=512,
    decode_rows=(1,), decode_tokens=(40,), split_kv=(2,), triton_splits=(2,),
    prefills=((5, 40),), hidden=64, intermediate=172, gemm_rows=(1, 4), reps=1,
)  # fmt: skip


@dataclass
class Probe:
    """One run: where it measures, at which shapes, where its lines go."""

    plan: Plan
    shapes: Shapes
    out: Path
    budget_s: float
    compile_limit_s: float
    device: str = field(init=False)

    def __post_init__(self):
        self.device = device_name(self.plan)

    @classmethod
    def for_device(cls, device: str, out: Path, budget_s: float | None = None) -> Probe:
        budget = BUDGET_S[device] if budget_s is None else budget_s
        plan = Plan.for_device(device, argparse.Namespace(sessions=[1], new_tokens=8,
                                                          shard_sessions=2))  # fmt: skip
        shapes = GPU_SHAPES if plan.cuda else CPU_SHAPES
        return cls(plan, shapes, out, budget, min(COMPILE_LIMIT_S[device], budget))

    def write(self, name: str, seconds: float, entries: dict) -> None:
        line = {"probe": name, "device": self.device, "torch": torch.__version__,
                "dtype": str(self.plan.dtype).removeprefix("torch."),
                "seconds": round(seconds, 2), **entries}  # fmt: skip
        text = json.dumps(line, default=str)
        print(text, flush=True)
        with open(self.out / "probe.jsonl", "a") as lines:
            lines.write(text + "\n")
            lines.flush()
            os.fsync(lines.fileno())


# A probe yields (what it measures, a call returning the figures) for each of its lines.
Case = tuple[dict, Callable[[], dict]]


def run_probe(probe: Probe, name: str, cases: Iterator[Case], deadline: float) -> None:
    """Each case of one probe, its line written as it ends: its figures, or its error (the
    traceback printed). A probe that fails to set up writes one error line and ends; past
    ``deadline`` (time.monotonic()) the next case's line says it was skipped and the probe
    ends."""
    while True:
        start = time.perf_counter()
        try:
            measured, measure = next(cases)
        except StopIteration:
            return
        except Exception as error:
            traceback.print_exc()
            probe.write(name, time.perf_counter() - start, {"error": error_line(error)})
            return
        if time.monotonic() > deadline:
            skipped = f"past the budget of {probe.budget_s:.0f} s"
            probe.write(name, 0, {**measured, "skipped": skipped})
            return
        try:
            figures = measure()
        except Exception as error:
            traceback.print_exc()
            figures = {"error": error_line(error)}
        probe.write(name, time.perf_counter() - start, {**measured, **figures})


# -- timing ---------------------------------------------------------------------------------
def graph_us(plan: Plan, call: Callable, reps: int) -> tuple[float, str]:
    """µs a call takes on the device, and how that was timed: on CUDA GRAPH_CALLS calls
    captured in one graph, each replay timed with CUDA events (the kernels alone, as a captured
    decode step runs them), the median of ``reps``; on the CPU ``wall_us``."""
    if not plan.cuda:
        return wall_us(plan, call, reps), "wall clock"
    from llava.exec.graphs import capture_graph  # warms the calls up, then captures

    graph, _outs = capture_graph(lambda: [call() for _ in range(GRAPH_CALLS)])
    replays = [event_ms(graph.replay) for _ in range(reps)]
    return statistics.median(replays) * 1e3 / GRAPH_CALLS, "cuda graph"


def eager_us(plan: Plan, call: Callable, reps: int) -> tuple[float, str]:
    """µs a call takes launched as it comes: on CUDA timed with events after one warm-up
    call, the median of ``reps``; on the CPU ``wall_us``."""
    if not plan.cuda:
        return wall_us(plan, call, reps), "wall clock"
    call()
    sync(plan)
    return statistics.median(event_ms(call) for _ in range(reps)) * 1e3, "cuda events"


def event_ms(call: Callable) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def wall_us(plan: Plan, call: Callable, reps: int) -> float:
    """The median wall time of ``reps`` calls after one (which compiles, if it does), each
    to the device's end: all a call costs, the host's part included."""
    call()
    times = []
    for _ in range(reps):
        sync(plan)
        start = time.perf_counter()
        call()
        sync(plan)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


# -- copies ---------------------------------------------------------------------------------
def copies(probe: Probe) -> Iterator[Case]:
    """Each direction between the device and host memory of three kinds: pinned, pageable,
    and a non-contiguous slice of pinned memory (every other run of a buffer twice the size,
    as a session's slots lie in a host copy of the pool)."""
    size, runs = probe.shapes.copy_bytes, probe.shapes.copy_runs
    pin = probe.plan.cuda  # pinning needs CUDA; the CPU run copies pageable memory thrice
    device = torch.empty(runs, size // runs, dtype=torch.uint8, device=probe.plan.device)
    hosts = {
        "pinned": torch.empty(runs, size // runs, dtype=torch.uint8, pin_memory=pin),
        "pageable": torch.empty(runs, size // runs, dtype=torch.uint8),
        "pinned_slice": torch.empty(runs, 2, size // runs, dtype=torch.uint8, pin_memory=pin)[:, 0],
    }
    for direction in ("host_to_device", "device_to_host"):
        for kind, host in hosts.items():
            measured = {"direction": direction, "host_memory": kind, "bytes": size}
            yield measured, partial(_copy_figures, probe, direction, host, device, pinned=pin)


def _copy_figures(probe: Probe, direction: str, host, device, pinned: bool) -> dict:
    """Wall time to the device's end: a copy from pageable or non-contiguous memory has host
    work (staging, gathering) that events on the stream would not see."""
    source, target = (host, device) if direction == "host_to_device" else (device, host)
    us = wall_us(probe.plan, lambda: target.copy_(source, non_blocking=True), probe.shapes.reps)
    return {"ms": round(us / 1e3, 3), "gb_per_s": round(host.nbytes / us / 1e3, 2),
            "pinned": pinned, "contiguous": host.is_contiguous(),
            "timing": "wall clock"}  # fmt: skip


# -- SDPA prefill ---------------------------------------------------------------------------
def sdpa_prefill(probe: Probe) -> Iterator[Case]:
    """A turn's prefill attention, ``new`` rows over ``total`` tokens of history and
    themselves: 3-D q/k/v with a boolean mask (as the engine ran it) and 4-D with
    ``causal_lower_right`` (what the fused kernels take); ms each, the difference between
    them and, on CUDA, the backend that ran and why each fused one was refused."""
    from torch.nn.attention.bias import causal_lower_right

    heads, dim = probe.shapes.heads, probe.shapes.head_dim
    for new, total in probe.shapes.prefills:
        torch.manual_seed(0)
        make = partial(torch.randn, device=probe.plan.device, dtype=probe.plan.dtype)
        q, k, v = make(heads, new, dim), make(heads, total, dim), make(heads, total, dim)
        rows = torch.arange(new, device=q.device)[:, None] + total - new
        boolean = torch.arange(total, device=q.device)[None, :] <= rows
        # each form's q/k/v, its mask, and the mask SDPA's backend checks see for it
        forms = {
            "3d_bool_mask": ((q, k, v), boolean, boolean),
            "4d_causal_lower_right": ((q[None], k[None], v[None]),
                                      causal_lower_right(new, total), None),
        }  # fmt: skip
        reference = F.scaled_dot_product_attention(q, k, v, attn_mask=boolean)
        for form, (qkv, mask, checked_mask) in forms.items():
            call = partial(F.scaled_dot_product_attention, *qkv, attn_mask=mask)
            measured = {"new_tokens": new, "total_tokens": total, "form": form}
            yield measured, partial(_sdpa_figures, probe, call, reference, qkv, checked_mask)


def _sdpa_figures(probe: Probe, call: Callable, reference, qkv, checked_mask) -> dict:
    us, timing = eager_us(probe.plan, call, probe.shapes.reps)
    diff = max_diff(call().reshape(reference.shape), reference)
    figures = {"ms": round(us / 1e3, 3), "timing": timing, "max_abs_diff_vs_3d": diff}
    if probe.plan.cuda:
        figures.update(cuda_sdpa_backend(*qkv, checked_mask))
    return figures


def cuda_sdpa_backend(q, k, v, mask) -> dict:
    """Which CUDA SDPA backend runs these inputs: the first fused one (flash, then
    efficient: torch's order, and the order ``causal_lower_right`` tries) whose check
    passes, else math; and each fused check's refusal, in torch's own words. ``mask``: the
    mask the checks see (``causal_lower_right`` hands them none)."""
    params = torch.backends.cuda.SDPAParams(q, k, v, mask, 0.0, False, False)
    checks = {"flash": torch.backends.cuda.can_use_flash_attention,
              "efficient": torch.backends.cuda.can_use_efficient_attention,
              "cudnn": torch.backends.cuda.can_use_cudnn_attention}  # fmt: skip
    refusals = {}
    for name, check in checks.items():
        with warnings.catch_warnings(record=True) as why:
            warnings.simplefilter("always")
            if not check(params, True):
                refusals[name] = "; ".join(str(w.message).splitlines()[0] for w in why)[:300]
    backend = next((n for n in ("flash", "efficient") if n not in refusals), "math")
    return {"backend": backend, "refusals": refusals}


# -- GEMMs ----------------------------------------------------------------------------------
def gemms(probe: Probe) -> Iterator[Case]:
    """q/k/v as three GEMMs against one over the merged weight, and gate/up likewise, at
    each row count (a decode step's rows)."""
    hidden, intermediate = probe.shapes.hidden, probe.shapes.intermediate
    make = partial(torch.randn, device=probe.plan.device, dtype=probe.plan.dtype)
    groups = {"qkv": [make(hidden, hidden) for _ in range(3)],
              "gate_up": [make(intermediate, hidden) for _ in range(2)]}  # fmt: skip
    for rows in probe.shapes.gemm_rows:
        x = make(rows, hidden)
        for weights, parts in groups.items():
            forms = {"separate": partial(_linears, x, parts),
                     "merged": partial(_linears, x, [torch.cat(parts)])}  # fmt: skip
            reference = torch.cat(forms["separate"](), dim=1)
            for form, call in forms.items():
                measured = {"rows": rows, "weights": weights, "form": form}
                yield measured, partial(_gemm_figures, probe, call, reference)


def _linears(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
    return [F.linear(x, w) for w in weights]


def _gemm_figures(probe: Probe, call: Callable, reference: torch.Tensor) -> dict:
    us, timing = graph_us(probe.plan, call, probe.shapes.reps)
    diff = max_diff(torch.cat(call(), dim=1), reference)
    return {"us": round(us, 2), "timing": timing, "max_abs_diff_vs_separate": diff}


# -- paged decode ---------------------------------------------------------------------------
def paged_decode(probe: Probe) -> Iterator[Case]:
    """One layer's decode attention over a pool of ``pool_slots`` slots, each row's blocks
    adjacent with a gap after them, at each row count and history: first flex with today's
    mask (full blocks listed), flex with partial blocks only and the Triton kernel, each at
    its own choice of splits; then flex partial at each SPLIT_KV and Triton at each split."""
    s = probe.shapes
    torch.manual_seed(0)
    keys = torch.randn(s.heads, s.pool_slots, s.head_dim, device=probe.plan.device,
                       dtype=probe.plan.dtype)  # fmt: skip
    values = torch.randn_like(keys)
    chosen = [("flex", "full", None), ("flex", "partial", None), ("triton", None, None)]
    swept = [("flex", "partial", n) for n in s.split_kv] + [
        ("triton", None, n) for n in s.triton_splits
    ]
    for variants in (chosen, swept):
        for rows in s.decode_rows:
            for kernel, layout, split in variants:
                for tokens in s.decode_tokens:
                    measured = {"rows": rows, "tokens": tokens, "kernel": kernel,
                                "layout": layout, "split": split}  # fmt: skip
                    yield measured, partial(_paged_figures, probe, keys, values, **measured)


def _paged_figures(probe, keys, values, rows, tokens, kernel, layout, split) -> dict:
    q, tables, positions = _rows_in_pool(probe, rows, tokens)
    if kernel == "flex":
        call = _flex_call(probe, keys, values, q, tables, positions, layout, split)
    else:
        call = _triton_call(probe, keys, values, q, tables, positions, split)
    us, timing = graph_us(probe.plan, call, probe.shapes.reps)
    reference = _sdpa_over_slots(keys, values, q, tables, positions, probe.shapes.block_tokens)
    return {"us": round(us, 2), "timing": timing, "max_abs_diff": max_diff(call(), reference),
            "pool_slots": probe.shapes.pool_slots}  # fmt: skip


def _rows_in_pool(probe: Probe, rows: int, tokens: int) -> tuple:
    """(q, tables, positions): ``rows`` query rows, each the last of ``tokens`` tokens whose
    blocks lie adjacent, every sequence followed by a gap of the longest history's size."""
    s, device = probe.shapes, probe.plan.device
    pool_blocks = s.pool_slots // s.block_tokens
    stride = 2 * -(-max(s.decode_tokens) // s.block_tokens)
    used = -(-tokens // s.block_tokens)
    tables = torch.zeros(rows, pool_blocks, dtype=torch.int32, device=device)
    for row in range(rows):
        tables[row, :used] = torch.arange(row * stride, row * stride + used)
    positions = torch.full((rows,), tokens - 1, dtype=torch.long, device=device)
    torch.manual_seed(rows)
    q = torch.randn(rows, s.heads, s.head_dim, device=device, dtype=probe.plan.dtype)
    return q, tables, positions


def _flex_call(probe, keys, values, q, tables, positions, layout, split) -> Callable:
    from llava.exec.attention import paged_attention, paged_block_mask

    mask = paged_block_mask(tables, positions, probe.shapes.block_tokens,
                            probe.shapes.pool_slots, layout=layout)  # fmt: skip
    scale = probe.shapes.head_dim**-0.5
    return partial(paged_attention, q, keys, values, mask, scale, split_kv=split)


def _triton_call(probe, keys, values, q, tables, positions, split) -> Callable:
    from llava.exec import triton_decode

    problem = triton_decode.unavailable(probe.plan.device)
    if problem:
        raise RuntimeError(problem)
    scale = probe.shapes.head_dim**-0.5
    return partial(triton_decode.paged_decode, q, keys, values, tables, positions,
                   probe.shapes.block_tokens, scale, splits=split)  # fmt: skip


def _sdpa_over_slots(keys, values, q, tables, positions, block_tokens: int) -> torch.Tensor:
    """The reference: each row's own slots gathered, one fp32 SDPA a row."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for row, position in enumerate(positions.tolist()):
        seen = torch.arange(position + 1, device=q.device)
        slots = tables[row, seen // block_tokens].long() * block_tokens + seen % block_tokens
        out[row] = F.scaled_dot_product_attention(
            q[row, :, None].float(), keys[:, slots].float(), values[:, slots].float(),
            scale=q.shape[-1] ** -0.5,
        )[:, 0]  # fmt: skip
    return out


# -- the whole-step compile -----------------------------------------------------------------
def step_compile(probe: Probe) -> Iterator[Case]:
    """scripts.gpu.steps.whole_step_compile in a process of its own under the run's compile
    limit (scripts.gpu_check runs it as it runs a step): a compile that hangs or crashes
    costs its line alone, and its output (the whole traceback too) goes to the console and
    ``DIR/compile.log``."""
    yield {"limit_s": probe.compile_limit_s}, partial(_compile_figures, probe)


def _compile_figures(probe: Probe) -> dict:
    if probe.plan.cuda:
        torch.cuda.empty_cache()  # the child sizes the engine's pool by the memory free
    args = argparse.Namespace(device=probe.plan.device.type, new_tokens=8, shard_sessions=2,
                              sessions=[1])  # fmt: skip
    with open(probe.out / "compile.log", "a") as log, tempfile.TemporaryDirectory() as tmp:
        line = isolated("compile", args, probe.compile_limit_s, Path(tmp) / "compile.json", log)
    figures = {"ok": line["ok"], **line["figures"]}
    if not line["ok"]:
        figures["error"] = line["error"].splitlines()[0]
    return figures


# The probe with a limit of its own, held back from the budget for it: it runs whatever the
# others took.
COMPILE = "step_compile"
PROBES = {"copies": copies, "sdpa_prefill": sdpa_prefill, "gemms": gemms,
          "paged_decode": paged_decode, COMPILE: step_compile}  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--probes", default=",".join(PROBES))
    parser.add_argument("--budget", type=float, help="seconds for the whole run")
    args = parser.parse_args(argv)
    args.probes = names_from(parser, args.probes, PROBES, "probe")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_probe: no CUDA device here (torch {torch.__version__}); nothing to probe")
        return 0
    if args.device == "cpu":  # the Triton kernel runs in its interpreter: set before triton
        os.environ.setdefault("TRITON_INTERPRET", "1")  # is imported (torch._inductor does)
    from torch._inductor import config as inductor

    # Compiles in this process, so a failing compile raises its own error (issue 48, item 5).
    inductor.compile_threads = 1
    args.out.mkdir(parents=True, exist_ok=True)
    probe = Probe.for_device(args.device, args.out, args.budget)
    held_back = probe.compile_limit_s if COMPILE in args.probes else 0
    shared_deadline = time.monotonic() + probe.budget_s - held_back
    with torch.inference_mode():
        for name in args.probes:
            deadline = math.inf if name == COMPILE else shared_deadline
            run_probe(probe, name, PROBES[name](probe), deadline)
            if probe.plan.cuda:
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
