"""scripts.gpu_probe: one JSON line a figure, written as found; a probe that raises costs its
own line and the next runs; past the budget the rest are skipped, each saying so. The
``--device cpu`` dry run proves every probe's code at tiny shapes (a GPU lease is too short
to find a typo in)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scripts.gpu.probe import CPU_SHAPES, PROBES, Probe, cuda_sdpa_backend, run_probe

REPO = Path(__file__).resolve().parents[2]
HEADER = {"probe", "device", "torch", "dtype", "seconds"}
# What each line of a probe measured, and the figures it found when it did not fail.
MEASURED = {
    "copies": {"direction", "host_memory", "bytes"},
    "sdpa_prefill": {"new_tokens", "total_tokens", "form"},
    "gemms": {"rows", "weights", "form"},
    "paged_decode": {"rows", "tokens", "kernel", "layout", "split"},
    "step_compile": {"limit_s"},
}
FIGURES = {
    "copies": {"ms", "gb_per_s", "pinned", "contiguous", "timing"},
    "sdpa_prefill": {"ms", "timing", "max_abs_diff_vs_3d"},
    "gemms": {"us", "timing", "max_abs_diff_vs_separate"},
    "paged_decode": {"us", "timing", "max_abs_diff", "pool_slots"},
    "step_compile": {"ok", "weights_gib", "build_s", "pool_gib", "attention_path", "backend",
                     "compile_s", "ids_equal_eager", "eager_step_ms", "compiled_step_ms"},
}  # fmt: skip


def lines_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "probe.jsonl").read_text().splitlines()]


# -- the loop, with stand-in probes -----------------------------------------------------------
def setup_fails(_probe):
    raise RuntimeError("no pool\nthe rest of the story")
    yield  # a generator: the error comes at its first case, as a probe's setup's would


def second_case_fails(_probe):
    yield {"case": 1}, lambda: {"x": 1.0}
    yield {"case": 2}, lambda: {"x": 1 / 0}
    yield {"case": 3}, lambda: {"x": 3.0}


def test_a_probe_that_raises_costs_its_own_line_and_the_rest_run(tmp_path):
    probe = Probe.for_device("cpu", tmp_path)
    run_probe(probe, "broken", setup_fails(probe), math.inf)
    run_probe(probe, "half", second_case_fails(probe), math.inf)
    broken, *half = lines_of(tmp_path)
    assert broken["error"] == "RuntimeError: no pool"  # one line
    assert set(broken) == HEADER | {"error"} and broken["device"] == "cpu"
    assert broken["torch"] == torch.__version__ and broken["dtype"] == "float32"
    assert [(line["case"], line.get("x"), line.get("error")) for line in half] == [
        (1, 1.0, None), (2, None, "ZeroDivisionError: division by zero"), (3, 3.0, None),
    ]  # fmt: skip


def test_past_its_deadline_a_probe_writes_a_skipped_line_and_ends(tmp_path):
    probe = Probe.for_device("cpu", tmp_path, budget_s=100)
    run_probe(probe, "late", second_case_fails(probe), deadline=0)
    (line,) = lines_of(tmp_path)  # the first case's, and no more
    assert line["case"] == 1 and line["skipped"] == "past the budget of 100 s", line
    assert "x" not in line and line["seconds"] == 0


def test_the_sdpa_backend_check_runs_on_both_forms():
    """CUDA's checks answer for CPU tensors too (every fused kernel refused): the code the
    dry run cannot reach (it asks only on CUDA) runs."""
    q, k = torch.randn(2, 5, 16), torch.randn(2, 40, 16)
    mask = torch.ones(5, 40, dtype=torch.bool)
    for form in (
        cuda_sdpa_backend(q, k, k, mask),
        cuda_sdpa_backend(q[None], k[None], k[None], None),
    ):
        assert form["backend"] == "math" and set(form["refusals"]) == {
            "flash",
            "efficient",
            "cudnn",
        }


# -- the dry run --------------------------------------------------------------------------------
def expected_lines(name: str) -> int:
    s = CPU_SHAPES
    decode = len(s.decode_rows) * len(s.decode_tokens)
    return {
        "copies": 2 * 3,  # each direction, pinned, pageable and the non-contiguous slice
        "sdpa_prefill": 2 * len(s.prefills),
        "gemms": 2 * 2 * len(s.gemm_rows),
        "paged_decode": (3 + len(s.split_kv) + len(s.triton_splits)) * decode,
        "step_compile": 1,
    }[name]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, list[dict], Path]:
    out = tmp_path_factory.mktemp("probe")
    command = [sys.executable, "-u", "-m", "scripts.gpu_probe", "--out", str(out),
               "--device", "cpu"]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=400)
    return done, lines_of(out), out


@pytest.mark.thorough  # a child process, CPU compiles of flex and of a whole step
def test_the_cpu_dry_run_writes_one_line_a_figure_in_probe_order(dry_run):
    done, lines, out = dry_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    names = [line["probe"] for line in lines]
    assert names == [name for name in PROBES for _ in range(expected_lines(name))]
    for line in lines:
        assert line["device"] == "cpu" and line["torch"] == torch.__version__, line
        assert HEADER | MEASURED[line["probe"]] <= set(line), line
        assert "skipped" not in line, line  # the CPU run fits its budget
        if "error" in line:  # one line, the traceback on the console
            assert "\n" not in line["error"] and line["error"] in done.stdout + done.stderr
        else:
            assert FIGURES[line["probe"]] <= set(line), line
    assert "== compile" in (out / "compile.log").read_text()


@pytest.mark.thorough
def test_the_copies_sdpa_and_gemm_probes_measure_on_the_cpu(dry_run):
    _done, lines, _out = dry_run
    by_probe = {name: [line for line in lines if line["probe"] == name] for name in PROBES}
    for line in by_probe["copies"] + by_probe["sdpa_prefill"] + by_probe["gemms"]:
        assert "error" not in line, line
    for line in by_probe["copies"]:
        assert line["gb_per_s"] > 0 and line["pinned"] is False  # nothing pins without CUDA
        assert line["contiguous"] is (line["host_memory"] != "pinned_slice"), line
    for line in by_probe["sdpa_prefill"]:  # the 4-D lower-right form computes the 3-D's
        assert line["ms"] > 0 and line["max_abs_diff_vs_3d"] < 1e-5, line
    for line in by_probe["gemms"]:  # the merged weight computes the separate ones
        assert line["us"] > 0 and line["max_abs_diff_vs_separate"] < 1e-5, line


@pytest.mark.thorough
def test_the_paged_kernels_and_the_whole_step_compile_run_on_the_cpu(dry_run):
    """Flex in both layouts and every SPLIT_KV, and the Triton kernel under its interpreter,
    compute SDPA's attention; the decode step compiles whole (aot_eager on a CPU)."""
    _done, lines, _out = dry_run
    for line in lines:
        if line["probe"] == "paged_decode":
            assert "error" not in line and line["max_abs_diff"] < 1e-4, line
    (compiled,) = [line for line in lines if line["probe"] == "step_compile"]
    assert compiled["ok"] is True and compiled["ids_equal_eager"] is True, compiled
    assert compiled["backend"] == "aot_eager"
