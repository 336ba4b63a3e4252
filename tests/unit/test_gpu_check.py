"""scripts.gpu_check with --device cpu: every step's code on the CPU, each step's JSON line
kept, a step that dies or runs past its budget costs that step alone (the GPU machine's lease
is too short for a run that breaks at its first step to start again)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts.gpu_check import DEFAULT_STEPS

pytestmark = pytest.mark.thorough  # each step is a child process that imports torch

REPO = Path(__file__).resolve().parents[2]
LINE_KEYS = {"step", "ok", "seconds", "device", "torch", "error", "figures"}


def gpu_check(out: Path, *flags: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    command = [sys.executable, "-u", "-m", "scripts.gpu_check", "--out", str(out), *flags]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=400)
    lines = (out / "results.jsonl").read_text().splitlines()
    return done, [json.loads(line) for line in lines]


def test_every_step_runs_on_the_cpu_and_writes_its_line(tmp_path):
    done, lines = gpu_check(tmp_path, "--device", "cpu")
    assert done.returncode == 0, done.stdout[-3000:]
    assert [line["step"] for line in lines] == list(DEFAULT_STEPS)
    for line in lines:
        assert set(line) == LINE_KEYS and line["ok"] and line["error"] is None, line
        assert line["device"] == "cpu" and line["seconds"] > 0
    figures = {line["step"]: line["figures"] for line in lines}
    assert figures["preflight"]["paged_vs_sdpa_max_diff"] < 1e-4
    assert figures["preflight"]["graph_vs_eager_max_diff"] == 0
    assert figures["attention"]["fastest_4_rows"] in figures["attention"]["ms_4_rows"]
    table = figures["table"]
    assert table["attention_path"] == "flex"  # the CPU run takes CUDA's path
    for key in ("decode_ms_per_token_1", "tokens_per_s_2", "tokens_per_s_4",
                "ttft_turn10_stateless_over_kv", "recompute_over_restore"):  # fmt: skip
        assert table[key] > 0, key
    assert table["turn10_prefill_tokens"] > 576  # the image and nine turns, prefilled again
    assert figures["tests"]["skipped"] >= 7  # the CUDA tests were collected, and skipped here
    assert figures["shards"]["sessions_by_shard"] == [2, 2]
    for sessions in ("sessions_1", "sessions_4"):  # where a decode step's time goes
        where = figures["profile"][sessions]
        assert where["wall_ms_per_step"] > 0 and where["top_host_ms_per_step"], where
    prefill = figures["profile"]["prefill_turn"]  # where a turn's time to first token goes
    assert prefill["new_tokens"] > 1 and prefill["ttft_ms"] > 0 and prefill["top_host_ms_per_step"]
    log = (tmp_path / "gpu_check.log").read_text()
    assert all(f"== {step}: ok" in log for step in DEFAULT_STEPS)


def test_a_step_past_its_budget_is_cut_with_its_stacks_and_the_next_one_runs(tmp_path):
    done, lines = gpu_check(
        tmp_path, "--device", "cpu", "--steps", "preflight,tests", "--budgets", "preflight=1"
    )
    assert done.returncode == 1
    cut, after = lines
    assert cut["step"] == "preflight" and not cut["ok"]
    assert cut["error"].startswith("step preflight ended: ran past its budget of 1 s")
    assert 'File "' in cut["error"]  # the stack faulthandler dumped
    assert isinstance(cut["figures"], dict)  # whatever it had found before the cut
    assert after["step"] == "tests" and after["ok"]
    assert "failed: preflight" in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: it would measure")
@pytest.mark.parametrize(
    "command", [["scripts.gpu_block_sizes"], ["scripts.gpu_compiled_decode", "eager", "out.json"]]
)
def test_a_gpu_experiment_without_cuda_says_so_in_one_line(command):
    command = [sys.executable, "-m", *command]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [done.stdout.strip()] and "no CUDA device" in done.stdout
