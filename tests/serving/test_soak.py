"""`make soak`, short: load, faults and bad input together through boto3 against the local
endpoint over two real TorchServe instances (scripts/soak/), its table's rules as the verdict.

Bounded: 40 s of load with 4 conversations, plus the endpoint's start and stop (~1.5 min here),
every fault included: the killed worker's sessions go on (the persistent tier).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.torchserve
CI_FAULTS = "kill,slow,reset,hangup,big,memory"


def test_a_short_soak_keeps_every_rule(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "scripts.soak", "--seconds", "40", "--sessions", "4"]
        + ["--faults", CI_FAULTS, "--run-dir", str(tmp_path / "soak")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    table = done.stdout
    broken = "\n".join(line for line in table.splitlines() if "**NO**" in line)
    assert "| sessions lost | 0 |" in table and "| bad inputs sent" in table, done.stderr[-3000:]
    assert done.returncode == 0, f"rules broken:\n{broken}\n{table[-2000:]}{done.stderr[-2000:]}"
