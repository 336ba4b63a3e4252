"""scripts.gpu_check with --device cpu: every step's code on the CPU, each step's JSON line
kept, a step that dies or runs past its budget costs that step alone (the GPU machine's lease
is too short for a run that breaks at its first step to start again)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from scripts.gpu.check import DEFAULT_STEPS
from scripts.gpu.steps import (
    HF_VARIANTS,
    Figures,
    _hf_variant,
    _ours_over_hf,
    _where_time_went,
    cuda_test_files,
    cuda_tests_problem,
    outcome_counts,
)

# each step is a child process that imports torch
thorough = pytest.mark.thorough

REPO = Path(__file__).resolve().parents[2]
LINE_KEYS = {"step", "ok", "seconds", "device", "torch", "error", "figures"}


def gpu_check(out: Path, *flags: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    command = [sys.executable, "-u", "-m", "scripts.gpu_check", "--out", str(out), *flags]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=400)
    lines = (out / "results.jsonl").read_text().splitlines()
    return done, [json.loads(line) for line in lines]


@thorough
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
    assert table["open_ms"] > 0 and table["open_prefill_tokens"] > 576  # the image, its prompt
    # every CUDA test was collected (test_gpu.py's, the pool's allocator test, ...), and skipped
    assert figures["tests"]["skipped"] >= 8 and "passed" not in figures["tests"]
    assert "tests/unit/test_kv_pool.py" in figures["tests"]["files"]
    assert figures["shards"]["sessions_by_shard"] == [2, 2]
    for sessions in ("sessions_1", "sessions_4"):  # where a decode step's time goes
        where = figures["profile"][sessions]
        assert where["wall_ms_per_step"] > 0 and where["top_host_ms_per_step"], where
    prefill = figures["profile"]["prefill_turn"]  # where a turn's time to first token goes
    assert prefill["new_tokens"] > 1 and prefill["ttft_ms"] > 0 and prefill["top_host_ms_per_step"]
    log = (tmp_path / "gpu_check.log").read_text()
    assert all(f"== {step}: ok" in log for step in DEFAULT_STEPS)


@thorough
def test_hf_generate_measures_transformers_and_ours_on_the_same_weights(tmp_path):
    done, lines = gpu_check(tmp_path, "--device", "cpu", "--steps", "hf_generate")
    assert done.returncode == 0, done.stdout[-3000:]
    (line,) = lines
    figures = line["figures"]
    assert line["ok"] and not [key for key in figures if key.endswith("_error")], figures
    hf = {variant: figures[f"hf_{variant}_ms_per_token"] for variant in HF_VARIANTS}
    assert all(ms > 0 for ms in hf.values()), hf
    assert figures["hf_compiled_forward"]  # generate ran its compiled forward, not eager again
    assert figures["hf_best"] == min(hf, key=hf.get)
    assert figures["ours_over_hf"] == round(figures["ours_ms_per_token_1"] / min(hf.values()), 3)
    assert figures["first_tokens_equal"] is True  # fp32: transformers' greedy ids, and ours


@thorough
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


@thorough
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: it would measure")
@pytest.mark.parametrize(
    "command", [["scripts.gpu.block_sizes"], ["scripts.gpu.compiled_decode", "eager", "out.json"]]
)
def test_a_gpu_experiment_without_cuda_says_so_in_one_line(command):
    command = [sys.executable, "-m", *command]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [done.stdout.strip()] and "no CUDA device" in done.stdout


# -- hf_generate's variants --------------------------------------------------------------------
def test_a_failing_hf_variant_costs_its_own_figure_and_ours_is_set_against_the_best(tmp_path):
    figures = Figures(tmp_path / "figures.json")

    def no_compile(**options):
        raise RuntimeError("no compile here\nits traceback")

    assert _hf_variant(figures, "compiled", no_compile) is None
    assert figures["hf_compiled_error"] == "RuntimeError: no compile here"
    assert _hf_variant(figures, "eager", lambda **options: (0.1, 8.0, [7, 9])) == [7, 9]
    assert figures["hf_eager_ms_per_token"] == 8.0 and figures["hf_eager_first_call_s"] == 0.1
    figures["hf_static_ms_per_token"] = 10.0
    _ours_over_hf(figures)
    assert "ours_over_hf" not in figures  # ours not measured yet
    figures["ours_ms_per_token_1"] = 4.0
    _ours_over_hf(figures)
    assert (figures["hf_best"], figures["ours_over_hf"]) == ("eager", 0.5)
    assert json.loads(figures.path.read_text())["ours_over_hf"] == 0.5  # written as found


# -- the tests step's rule ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "counts, cuda, problem",
    [
        ({}, True, "no CUDA test passed"),  # pytest's exit 5: nothing collected
        ({"skipped": 8}, True, "no CUDA test passed"),  # every test skipped on a CUDA host
        ({"passed": 7, "skipped": 1}, True, None),
        ({"passed": 7, "failed": 1}, True, "1 CUDA tests failed or errored"),
        ({"passed": 7, "errors": 2}, True, "2 CUDA tests failed or errored"),
        ({"skipped": 8}, False, None),  # the CPU run: collected, and skipped
        ({}, False, "no CUDA test skipped"),
    ],
)
def test_the_tests_step_needs_a_cuda_test_passed_and_none_failed(counts, cuda, problem):
    assert cuda_tests_problem(counts, cuda) == problem


def test_pytest_closing_lines_are_read_as_counts():
    assert outcome_counts("1 failed, 7 passed, 2 skipped, 1 error in 3.20s") == {
        "failed": 1, "passed": 7, "skipped": 2, "errors": 1,
    }  # fmt: skip
    assert outcome_counts("8 skipped, 1230 deselected in 2.01s") == {"skipped": 8}
    assert outcome_counts("no tests ran in 0.01s") == {}


def test_every_test_that_skips_without_cuda_is_run_by_the_tests_step():
    found = cuda_test_files()
    assert {"tests/unit/test_gpu.py", "tests/unit/test_kv_pool.py"} <= set(found)
    # skipped without CUDA: `skipif(not torch.cuda.is_available(), ...)`, or `not CUDA` of a
    # module's own CUDA = torch.cuda.is_available()
    needs_cuda = re.compile(r"skipif\(\s*not\s+(torch\.cuda\.is_available\(\)|CUDA\b)")
    unmarked = [
        str(path.relative_to(REPO))
        for path in sorted((REPO / "tests").rglob("test_*.py"))
        if needs_cuda.search(path.read_text()) and str(path.relative_to(REPO)) not in found
    ]
    assert unmarked == [], "mark their CUDA tests pytest.mark.gpu: the tests step runs -m gpu"


# -- the profile's arithmetic ------------------------------------------------------------------
def event(key, count=1, device_us=0, cpu_us=0, device_type=DeviceType.CPU):
    """A stand-in for one row of torch.profiler's key_averages()."""
    return SimpleNamespace(
        key=key, count=count, device_type=device_type, self_device_time_total=device_us,
        self_cpu_time_total=cpu_us,
    )  # fmt: skip


def test_the_profile_counts_each_kernel_once_on_the_device_side():
    cuda = DeviceType.CUDA
    rows = [
        event("aten::mm", 4, device_us=800, cpu_us=60),  # the host op: its kernels' time again
        event("nvjet_gemm", 4, device_us=800, device_type=cuda),
        event("triton_tem_fused_flex_attention_0", 2, device_us=300, device_type=cuda),
        event("Memcpy HtoD (Pageable -> Device)", 2, device_us=100, device_type=cuda),
        event("cudaLaunchKernel", 4, cpu_us=20),
        event("cudaLaunchKernelExC", 2, cpu_us=10),
        event("cuLaunchKernelEx", 2, cpu_us=10),
        event("cudaGraphLaunch", 2, cpu_us=30),
        event("cudaMemcpyAsync", 2, cpu_us=40),
        event("cudaStreamSynchronize", 2, cpu_us=500),
    ]
    where = _where_time_went(rows, wall_s=0.004, steps=2)
    assert where["kernel_ms_per_step"] == 0.6  # (800 + 300 + 100) µs over 2 steps, not 1.0
    assert where["kernels_per_step"] == 4
    assert where["kernel_launches_per_step"] == 4  # every launch call: 8 over 2 steps
    assert (where["graph_launches_per_step"], where["copies_per_step"]) == (1, 1)
    assert where["syncs_per_step"] == 1 and where["profiled_wall_ms_per_step"] == 2
    assert list(where["top_kernels_ms_per_step"]) == [
        "nvjet_gemm", "triton_tem_fused_flex_attention_0", "Memcpy HtoD (Pageable -> Device)",
    ]  # fmt: skip
    assert next(iter(where["top_host_ms_per_step"])) == "cudaStreamSynchronize"
