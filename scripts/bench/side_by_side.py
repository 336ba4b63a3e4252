"""The concurrency bench of this checkout and of another (an older commit), interleaved.

    python -m scripts.bench.side_by_side --base /path/to/older/checkout [--rounds 2]
                                         [-- scripts/bench/concurrency.py options]

Runs ``scripts/bench/concurrency.py`` of each checkout in turn, alternating which goes first
each round, with this checkout's Python and model (both load ``build/realistic-llava`` of this
checkout), so the two versions see the same machine load. Prints every run's table, then each
row's median tokens/s and tokens per CPU-second for both and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run(checkout: Path, extra: list[str]) -> dict[tuple[str, str, str], tuple[float, float]]:
    """One bench run; {(N, turns, mode): (tokens/s, tokens per CPU-second)}."""
    model = ["--model-dir", str(REPO / "build" / "realistic-llava")]
    # As a module from the checkout's root: its own llava/ is imported, not the installed one.
    # Checkouts from before scripts/bench/ name it scripts.bench_concurrency.
    moved = (checkout / "scripts" / "bench" / "concurrency.py").is_file()
    bench = "scripts.bench.concurrency" if moved else "scripts.bench_concurrency"
    cmd = [sys.executable, "-m", bench, *model, *extra]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=checkout).stdout
    print(f"--- {checkout}\n{out}", flush=True)
    rows = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 7 and parts[0].isdigit() and parts[1].isdigit():
            rows[(parts[0], parts[1], parts[2])] = (float(parts[3]), float(parts[5]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="the older checkout")
    parser.add_argument("--rounds", type=int, default=2)
    args, extra = parser.parse_known_args()
    extra = [e for e in extra if e != "--"]
    results: dict[str, list[dict]] = {"before": [], "after": []}
    for index in range(args.rounds):
        order = [("before", args.base), ("after", REPO)]
        for name, checkout in order if index % 2 == 0 else order[::-1]:
            results[name].append(run(checkout, extra))
    keys = [k for k in results["after"][0] if all(k in r for r in results["before"])]
    print(f"medians of {args.rounds} interleaved runs each")
    print(
        f"{'N':>3} {'turns':>5} {'mode':>14} {'before tok/s':>13} {'after tok/s':>12} "
        f"{'ratio':>6} {'before tok/cpu-s':>17} {'after tok/cpu-s':>16} {'ratio':>6}"
    )
    for key in keys:
        before = [r[key] for r in results["before"]]
        after = [r[key] for r in results["after"]]
        wall = [statistics.median(x[0] for x in v) for v in (before, after)]
        cpu = [statistics.median(x[1] for x in v) for v in (before, after)]
        print(
            f"{key[0]:>3} {key[1]:>5} {key[2]:>14} {wall[0]:>13.1f} {wall[1]:>12.1f} "
            f"{wall[1] / wall[0]:>5.2f}x {cpu[0]:>17.1f} {cpu[1]:>16.1f} {cpu[1] / cpu[0]:>5.2f}x"
        )


if __name__ == "__main__":
    main()
