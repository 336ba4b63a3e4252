"""scripts/bench/openai_resend.py on the demo model, smallest settings: its table's rows and
columns, and what they must show (without reuse the whole conversation and the image are
computed again; the default sharing reuses the image and the opening, ``all`` more; a session
prefills only the new user message; every way gives the same answer). No timing is asserted
beyond the table holding together."""

from __future__ import annotations

import pytest

from scripts.bench import openai_resend as bench
from tests.unit.test_bench_images import number, run_printed, table_rows

SMALLEST = ["--shape", "demo", "--rounds", "1", "--turns", "2", "--new-tokens", "2"]
COLUMNS = [
    "way",
    "prefix_sharing",
    "TTFT ms",
    "min..max ms",
    "engine ttft_s ms",
    "prompt tokens",
    "cached tokens",
    "tokens prefilled",
    "vision tower runs",
    "answer as ask's",
    "conversation s",
    "vs stateless",
]
IMAGE_TOKENS = 64  # the demo model's 64 px image


@pytest.fixture(scope="module")
def run() -> tuple[str, dict]:
    """What the bench prints and returns, run once for every test here."""
    return run_printed(bench.main, SMALLEST)


@pytest.fixture(scope="module")
def rows(run) -> dict[str, dict[str, str]]:
    body = table_rows(run[0], COLUMNS)
    assert [row["way"] for row in body] == list(bench.WAYS)
    assert [row["prefix_sharing"] for row in body] == ["off", "opening", "all"] + ["opening"] * 2
    return {row["way"]: row for row in body}


def prefilled(row: dict[str, str]) -> float:
    assert number(row["tokens prefilled"]) == number(row["prompt tokens"]) - number(
        row["cached tokens"]
    )
    return number(row["tokens prefilled"])


def test_the_header_names_the_turn_the_rounds_and_the_shape(run):
    printed = run[0]
    assert printed.startswith(
        "turn 2 of 2, the conversation resent: time to first token, median of 1 rounds"
    )
    assert "2 new tokens an answer, greedy" in printed
    assert "demo: demo-llava" in printed


def test_without_reuse_the_image_and_the_whole_conversation_are_computed_again(rows):
    row = rows["stateless, no reuse"]
    assert number(row["cached tokens"]) == 0
    assert row["vision tower runs"] == "1"
    # the image, both questions, the first answer and the template around them
    assert number(row["prompt tokens"]) > IMAGE_TOKENS + 2


def test_the_resent_conversation_reuses_what_the_sharing_allows(rows):
    off, opening, every = (rows[way] for way in bench.WAYS[:3])
    # every chat way sends the same conversation (the same answers came back)
    assert opening["prompt tokens"] == off["prompt tokens"] == every["prompt tokens"]
    # the default: the image's features and the opening's full blocks, never the caller's text
    assert opening["vision tower runs"] == every["vision tower runs"] == "0"
    assert number(opening["cached tokens"]) >= IMAGE_TOKENS
    assert number(opening["cached tokens"]) % 16 == 0  # whole KV blocks
    # all: the earlier call's blocks of the conversation too
    assert number(every["cached tokens"]) >= number(opening["cached tokens"])
    assert prefilled(off) > prefilled(opening) >= prefilled(every)


def test_a_session_prefills_the_new_user_message_alone(rows):
    session, asked = rows["resent, session"], rows["ask, session"]
    assert session["prompt tokens"] == rows["stateless, no reuse"]["prompt tokens"]
    assert session["vision tower runs"] == asked["vision tower runs"] == "0"
    # the question and its template, nothing of the history
    assert 0 < prefilled(session) < prefilled(rows["resent, opening"])
    assert prefilled(session) < IMAGE_TOKENS
    assert 0 < prefilled(asked) < IMAGE_TOKENS


def test_every_way_gives_the_sessions_answer(rows, run):
    assert [rows[way]["answer as ask's"] for way in bench.WAYS] == ["yes"] * len(bench.WAYS)
    assert all(row.same_answer for row in run[1].values())


def test_times_hold_together(rows):
    assert rows["stateless, no reuse"]["vs stateless"] == "1.00x"
    for row in rows.values():
        ttft = number(row["TTFT ms"])
        low, high = (number(part) for part in row["min..max ms"].split(".."))
        assert 0 <= low <= ttft <= high
        # the engine's own ttft_s is within the caller's clock (it starts later, ends earlier)
        assert number(row["engine ttft_s ms"]) <= ttft + 1
        assert number(row["conversation s"]) * 1000 >= ttft - 100  # one decimal printed


@pytest.mark.parametrize(
    "argv",
    [
        ["--turns", "1"],
        ["--turns", "21"],
        ["--rounds", "0"],
        ["--rounds", "11"],
        ["--new-tokens", "0"],
        ["--new-tokens", "65"],
        ["--shape", "bogus"],
    ],
)
def test_out_of_bounds_options_are_refused(argv):
    with pytest.raises(SystemExit) as refused:
        bench.parse_args(argv)
    assert refused.value.code == 2


def test_defaults_are_the_realistic_run():
    args = bench.parse_args([])
    assert (args.shape, args.rounds, args.turns, args.new_tokens) == ("llava-1.5", 3, 10, 32)
