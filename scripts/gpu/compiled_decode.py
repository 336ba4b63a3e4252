"""Decode ms/token at one session on the 7B shape, its bucket-1 graph captured from the eager
step (as served) or from the step compiled whole by inductor (on a lent GPU machine).

    python3 -u -m scripts.gpu.compiled_decode {eager,inductor} OUT.json

The engine as ``make gpu-check``'s table serves it (scripts.gpu.steps.served_7b), with
``max_batch`` 1 so only bucket 1 is captured; ``inductor`` swaps the capture of
llava.exec.graphs for one of ``torch.compile(runner.decode, fullgraph=True)``. Figures are
written as found. Results: docs/performance.md §Decode compiled whole.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch._inductor.config

import llava.exec.graphs as graphs
from demo_model.synthetic import held_out_samples
from scripts.gpu.steps import QUESTIONS, Figures, Plan, served_7b


def capture_compiled(runner, step) -> None:
    """llava.exec.graphs._capture, of the step compiled whole by inductor."""
    compiled = torch.compile(runner.decode, fullgraph=True, dynamic=False)
    step.graph, step.out = graphs.capture_graph(lambda: compiled(*step.inputs()))


def main(mode: str, out: Path) -> None:
    if not torch.cuda.is_available():
        print(f"gpu_compiled_decode: no CUDA device here (torch {torch.__version__})")
        return
    if mode == "inductor":
        # In this process, so a failed compile raises its own error (not SubprocException).
        torch._inductor.config.compile_threads = 1
        graphs._capture = capture_compiled
    shape = argparse.Namespace(sessions=[1], new_tokens=64, shard_sessions=4)
    plan = Plan.for_device("cuda", shape)
    figures = Figures(out)
    figures["mode"] = mode
    engine, _weights = served_7b(plan, figures)
    with torch.inference_mode():
        figures["warm_up_s"] = round(engine.warm_up(), 1)
        figures["graph_buckets"] = sorted(engine.runner.graphs.steps)
        figures["capture_s"] = round(engine.runner.graphs.capture_s, 1)
        session = engine.open(held_out_samples(1, seed=80_000)[0].image).session_id
        forced = {"max_new_tokens": 128, "min_new_tokens": 128}
        per_token, ids = [], []
        for _ in range(3):
            answer = engine.ask(session, QUESTIONS[1], forced)
            per_token.append((answer.total_s - answer.ttft_s) / (len(answer.token_ids) - 1))
            ids.append(list(answer.token_ids))
        figures["decode_ms_per_token_1"] = round(statistics.median(per_token) * 1e3, 2)
        figures["first_ids"] = ids[0][:16]
    engine.stop()
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    modes = ("eager", "inductor")
    if len(sys.argv) != 3 or sys.argv[1] not in modes:
        sys.exit(f"usage: python -m scripts.gpu.compiled_decode {{{','.join(modes)}}} OUT.json")
    main(sys.argv[1], Path(sys.argv[2]))
