"""scripts/bench/images.py on the demo model, smallest settings: its table's rows and columns,
and what they must show (the session prefills only the new message; stateless everything)."""

from __future__ import annotations

import io
from contextlib import redirect_stdout

import pytest

from scripts.bench import images as bench

SMALLEST = ["--shapes", "demo", "--rounds", "1", "--turns", "2", "--image-turn", "2"]
COLUMNS = [
    "shape",
    "way",
    "TTFT ms",
    "min..max ms",
    "engine ttft_s ms",
    "tokens prefilled",
    "image tokens prefilled",
    "vision tower runs",
    "session's images",
    "vs in session",
]


def cells(line: str) -> list[str]:
    assert line.startswith("| ") and line.endswith(" |"), line
    return [cell.strip() for cell in line[2:-2].split(" | ")]


def number(cell: str) -> float:
    return float(cell.replace(",", "").rstrip("x"))


def run_printed(main, argv: list[str]) -> tuple[str, object]:
    """What a bench's ``main(argv)`` prints, and what it returns."""
    out = io.StringIO()
    with redirect_stdout(out):
        returned = main(argv)
    return out.getvalue(), returned


def table_rows(printed: str, columns: list[str]) -> list[dict[str, str]]:
    """The printed table's rows by column, its header checked."""
    lines = [line for line in printed.splitlines() if line.startswith("|")]
    assert cells(lines[0]) == columns
    assert set(lines[1]) <= set("|-:")
    return [dict(zip(columns, cells(line), strict=True)) for line in lines[2:]]


@pytest.fixture(scope="module")
def printed() -> str:
    """What the bench prints, run once for every test here."""
    out = io.StringIO()
    with redirect_stdout(out):
        bench.main([*SMALLEST, "--new-tokens", "2"])
    return out.getvalue()


@pytest.fixture(scope="module")
def rows(printed) -> dict[str, dict[str, str]]:
    lines = [line for line in printed.splitlines() if line.startswith("|")]
    assert cells(lines[0]) == COLUMNS
    assert set(lines[1]) <= set("|-:")
    body = [dict(zip(COLUMNS, cells(line), strict=True)) for line in lines[2:]]
    assert [(row["shape"], row["way"]) for row in body] == [("demo", way) for way in bench.WAYS]
    return {row["way"]: row for row in body}


def test_the_header_names_the_image_turn_and_the_rounds(printed):
    assert printed.startswith("a second image at turn 2 of 2: time to first token, median of 1")
    assert "demo: demo-llava" in printed


def test_the_session_prefills_the_new_message_alone_and_stateless_everything(rows):
    session, new, stateless = (rows[way] for way in bench.WAYS)
    image = number(session["image tokens prefilled"])
    assert image == 64  # the demo model's 64 px image
    # the session: the second image's tokens and the question, nothing of the history
    assert image < number(session["tokens prefilled"]) < number(stateless["tokens prefilled"])
    # stateless: both images' tokens, the history (the first image's opening, turn 1) on top
    assert number(stateless["image tokens prefilled"]) == 2 * image
    assert number(stateless["tokens prefilled"]) > number(session["tokens prefilled"]) + image
    # a new session: its own opening (the one image) and the question
    assert number(new["image tokens prefilled"]) == image
    assert number(new["tokens prefilled"]) > image


def test_vision_runs_and_images_held(rows):
    assert [rows[way]["vision tower runs"] for way in bench.WAYS] == ["1", "1", "2"]
    assert [rows[way]["session's images"] for way in bench.WAYS] == ["2", "1", "-"]


def test_times_are_measured_and_relative_to_the_session(rows):
    session, new, stateless = (rows[way] for way in bench.WAYS)
    assert session["vs in session"] == "1.0x"
    for row in rows.values():
        assert number(row["TTFT ms"]) >= 0
        low, high = (number(part) for part in row["min..max ms"].split(".."))
        assert low <= number(row["TTFT ms"]) <= high
    # the engine's own ttft_s is within the caller's clock (it starts later, ends earlier)
    for row in (session, new):
        assert number(row["engine ttft_s ms"]) <= number(row["TTFT ms"]) + 1
    assert stateless["engine ttft_s ms"] == "-"


@pytest.mark.parametrize(
    "argv",
    [
        ["--image-turn", "1"],  # the first turn is the open's image
        ["--turns", "4", "--image-turn", "5"],
        ["--rounds", "0"],
        ["--rounds", "11"],
        ["--turns", "21"],
        ["--new-tokens", "0"],
        ["--shapes", "llava-1.5,bogus"],
        ["--shapes", ","],
    ],
)
def test_out_of_bounds_options_are_refused(argv):
    with pytest.raises(SystemExit) as refused:
        bench.parse_args(argv)
    assert refused.value.code == 2


def test_defaults_are_the_small_realistic_run():
    args = bench.parse_args([])
    assert (args.shapes, args.rounds, args.turns, args.image_turn) == (
        ["llava-1.5", "next"],
        3,
        10,
        6,
    )
