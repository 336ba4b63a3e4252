"""scripts/bench/resume.py on the demo model, smallest settings: its table's rows and columns,
and what they must show (the resumed answer is the uninterrupted one, token for token, with no
vision tower run on the new instance; replay decodes every earlier answer again). No timing
is asserted beyond the table holding together."""

from __future__ import annotations

import re

import pytest

from scripts.bench import resume as bench
from tests.unit.test_bench_images import number, run_printed, table_rows

SMALLEST = ["--shape", "demo", "--rounds", "1", "--turns", "2", "--new-tokens", "2"]
COLUMNS = [
    "way",
    "to the next answer ms",
    "min..max ms",
    "to its first token ms",
    "tokens prefilled",
    "tokens decoded",
    "vision tower runs",
    "token-equal",
    "keeps the conversation",
    "vs resume",
]


@pytest.fixture(scope="module")
def run() -> tuple[str, dict]:
    """What the bench prints and returns, run once for every test here."""
    return run_printed(bench.main, SMALLEST)


@pytest.fixture(scope="module")
def rows(run) -> dict[str, dict[str, str]]:
    body = table_rows(run[0], COLUMNS)
    assert [row["way"] for row in body] == list(bench.WAYS)
    return {row["way"]: row for row in body}


def test_the_header_names_the_turns_the_parts_the_bytes_and_the_target(run):
    printed = run[0]
    assert printed.startswith("the next answer after 2 turns, on another instance: median of 1")
    assert "demo: demo-llava" in printed
    parts = re.search(r"the resume call ([\d,]+) ms, .* first token ([\d,]+) ms", printed)
    assert parts is not None
    stored = re.search(r"its record ([\d,]+) bytes, its image's features ([\d,]+) bytes", printed)
    assert stored is not None
    record, features = (number(value) for value in stored.groups())
    assert 0 < record < features  # the history is small; 64 image tokens' features are not
    assert re.search(r"resume against replay: [\d.]+x faster .* (holds|does not hold)", printed)


def test_the_resumed_answer_is_the_uninterrupted_one_without_the_vision_tower(rows, run):
    resumed, replayed, fresh = (rows[way] for way in bench.WAYS)
    assert resumed["token-equal"] == "yes" and run[1]["resume"].token_equal
    assert replayed["token-equal"] == "yes"  # greedy: the regenerated answers are the same
    # the features came from the store: the new instance ran no vision tower for the resume
    assert [rows[way]["vision tower runs"] for way in bench.WAYS] == ["0", "1", "1"]
    assert [rows[way]["keeps the conversation"] for way in bench.WAYS] == ["yes", "yes", "no"]
    assert fresh["token-equal"] in ("yes", "no")


def test_replay_decodes_every_answer_again_and_resume_prefills_the_history(rows):
    resumed, replayed, fresh = (rows[way] for way in bench.WAYS)
    # 2 new tokens an answer: resume and a fresh open decode one answer, replay three
    assert [number(rows[way]["tokens decoded"]) for way in bench.WAYS] == [2, 6, 2]
    # resume prefills the whole history (the answers included) in its one turn; a fresh open
    # prefills the opening and the question only
    assert number(resumed["tokens prefilled"]) > number(fresh["tokens prefilled"]) > 64
    history = number(replayed["tokens prefilled"]) + number(replayed["tokens decoded"])
    assert number(resumed["tokens prefilled"]) <= history


def test_times_hold_together(rows):
    assert rows["resume"]["vs resume"] == "1.0x"
    for row in rows.values():
        answer = number(row["to the next answer ms"])
        low, high = (number(part) for part in row["min..max ms"].split(".."))
        assert low <= answer <= high
        assert 0 <= number(row["to its first token ms"]) <= answer + 1


@pytest.mark.parametrize(
    "argv",
    [
        ["--turns", "0"],
        ["--turns", "21"],
        ["--rounds", "0"],
        ["--rounds", "11"],
        ["--new-tokens", "0"],
        ["--new-tokens", "129"],
        ["--shape", "bogus"],
    ],
)
def test_out_of_bounds_options_are_refused(argv):
    with pytest.raises(SystemExit) as refused:
        bench.parse_args(argv)
    assert refused.value.code == 2


def test_defaults_are_the_realistic_run():
    args = bench.parse_args([])
    assert (args.shape, args.rounds, args.turns, args.new_tokens) == ("llava-1.5", 3, 10, 64)
