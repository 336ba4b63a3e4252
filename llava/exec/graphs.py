"""Decode steps at static shapes: the batch padded to a bucket, the block tables to the pool's
width, so one captured CUDA graph per bucket replays a whole step (every layer, attention,
sampling) with one launch.

Each bucket owns its input buffers; a step stages its rows in one pinned upload and copies them
into those buffers on the device, then replays. A row is one new id at one position of its
sequence, so a short prefill with no image (a question's tokens) rides in the same graph as
extra rows beside other sessions' decode rows: each of its rows sees its sequence's positions up
to its own (their K/V are written before attention reads them), and only its last row's id is
kept. Padding rows decode id 0 at position 0 of a scratch block the pool sets aside for these
graphs (so their K/V writes land nowhere that matters) and their ids are dropped. Graphs are
captured at start-up from the smallest bucket up while the memory they take fits
``budget_bytes``; what each took (allocator-reserved bytes) and the capture time are recorded. A
bucket whose capture raises (the compile in its warm-up included) is left uncaptured, logged
once and counted: its steps run eagerly, the worker serves on; running out of memory ends the
captures, as before (docs/engine/execution.md §Decode graphs).
"""

from __future__ import annotations

import gc
import itertools
import logging
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from llava.exec.attention import BUCKETS
from llava.exec.step_meta import StepBuffers
from llava.sampling.chooser import Chooser
from llava.sampling.sampler import SamplingRows

logger = logging.getLogger(__name__)
# The least memory decode graphs may take: on an H200 a demo model's 1 GiB pool (a twentieth:
# 51 MiB) held no graph at all, and the 7B's seven buckets took 614 MiB
# (docs/engine/execution.md §Decode graphs). It comes out of the device headroom, not out of the
# pool.
GRAPHS_BUDGET_FLOOR = 512 << 20


def bucket_for(batch: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds ``batch`` rows, None when none does."""
    return next((b for b in sorted(buckets) if b >= batch), None)


@dataclass
class StaticDecode:
    """One bucket's input buffers, and the step over them (eager, compiled or captured)."""

    ids: torch.Tensor
    positions: torch.Tensor
    tables: torch.Tensor
    rows: SamplingRows
    staging: StepBuffers  # the pinned upload ``fill`` stages a step's rows in
    out: torch.Tensor | None = None
    graph: object = None  # torch.cuda.CUDAGraph once captured

    @classmethod
    def empty(cls, size: int, pool_blocks: int, device) -> StaticDecode:
        long = {"dtype": torch.long, "device": device}
        return cls(
            torch.zeros(size, **long),
            torch.zeros(size, **long),
            torch.zeros(size, pool_blocks, dtype=torch.int32, device=device),
            SamplingRows(
                torch.zeros(size, dtype=torch.bool, device=device),
                torch.ones(size, dtype=torch.bool, device=device),
                torch.ones(size, 3, device=device),
                torch.zeros(size, 2, **long),
            ),
            StepBuffers(device),  # grows once if a step needs more
        )

    def inputs(self) -> tuple:
        return self.ids, self.positions, self.tables, self.rows

    def fill(self, batch, choosers: Sequence[Chooser], scratch_block: int, sampler) -> None:
        """Copy a batch's rows in, one row per new id (``rows_of``); the rows past them decode
        into the scratch block. One upload of everything the host knows, then device copies."""
        size = self.ids.shape[0]
        rows = rows_of(batch, choosers)
        n, pad = len(rows), size - len(rows)
        # Only a row's first (position // block_tokens + 1) entries are read: stage those.
        width = max(len(item.kv.blocks) for item in batch)
        flags, values, counters = sampler.row_values([c for *_, c in rows] + [choosers[0]] * pad)
        staged = self.staging.upload(
            [token for token, *_ in rows] + [0] * pad
            + [position for _, position, *_ in rows] + [0] * pad
            + [flag for pair in flags for flag in pair]
            + [value for pair in counters for value in pair]
            + [_float_bits(value) for triple in values for value in triple]
            + [b for _, _, blocks, _ in rows for b in blocks + [0] * (width - len(blocks))]
        )  # fmt: skip
        cuts = itertools.accumulate((size, size, 2 * size, 2 * size, 3 * size))
        ids, positions, flags_t, counters_t, bits, tables = staged.tensor_split(list(cuts))
        self.ids.copy_(ids)
        self.positions.copy_(positions)
        self.rows.hold_eos.copy_(flags_t[0::2] != 0)
        self.rows.greedy.copy_(flags_t[1::2] != 0)
        self.rows.counters.copy_(counters_t.view(size, 2))
        self.rows.values.copy_(bits.to(torch.int32).view(torch.float32).view(size, 3))
        self.tables[:n, :width].copy_(tables.view(n, width))
        self.tables[n:, 0] = scratch_block


def rows_of(batch, choosers: Sequence[Chooser]) -> list[tuple[int, int, list[int], Chooser]]:
    """Each new id of the batch as a row: (id, its position, its sequence's blocks, the
    sequence's chooser)."""
    return [
        (token, item.kv.length + offset, item.kv.blocks, chooser)
        for item, chooser in zip(batch, choosers, strict=True)
        for offset, token in enumerate(item.ids)
    ]


def _float_bits(value: float) -> int:
    """A float32's bits as an int (the staging buffer is int64; the device views them back)."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


class DecodeGraphs:
    """Captured decode steps of one runner, by bucket (CUDA only)."""

    def __init__(self, runner, buckets: Sequence[int] = BUCKETS):
        self.runner = runner
        self.buckets = tuple(sorted(buckets))
        self.steps: dict[int, StaticDecode] = {}
        self.reserved_bytes = 0  # allocator-reserved bytes the captured graphs added
        self.capture_s = 0.0
        self.failed: dict[int, str] = {}  # bucket → why its capture raised (it runs eagerly)
        self.scratch_block = runner.pool.set_aside()

    def capture(self, max_batch: int, budget_bytes: int) -> list[int]:
        """Capture the buckets up to ``max_batch`` while their memory fits ``budget_bytes``;
        returns the buckets captured. Out of memory ends the captures; any other error leaves
        its bucket uncaptured (``failed``: logged once here, the batches it would hold run
        eagerly) and the next bucket is tried."""
        device = self.runner.pool.kv.device
        start = time.perf_counter()
        largest = bucket_for(max_batch, self.buckets) or self.buckets[-1]
        for size in (b for b in self.buckets if b <= largest):
            _release_cached(device)
            before = _reserved_bytes(device)
            step = StaticDecode.empty(
                size, self.runner.pool_slots // self.runner.pool.block_tokens, device
            )
            step.tables.fill_(self.scratch_block)
            try:
                _capture(self.runner, step)
            except torch.cuda.OutOfMemoryError:
                break
            except Exception as e:  # a compile or capture that fails costs its bucket alone
                self.failed[size] = one_line(e)
                logger.warning(
                    "decode graph of bucket %d not captured (its steps run eagerly): %s",
                    size,
                    self.failed[size],
                )
                continue
            added = _reserved_bytes(device) - before
            if self.reserved_bytes + added > budget_bytes:
                break
            self.reserved_bytes += added
            self.steps[size] = step
        self.capture_s = time.perf_counter() - start
        return sorted(self.steps)

    def run(self, batch, choosers: Sequence[Chooser]) -> list[int] | None:
        """The next id of each sequence of the batch from the graph of the bucket that holds
        its rows (one a new id: decodes, and prefills with no image); None if a sequence
        brings image features or no captured bucket holds the rows."""
        if any(item.image_features is not None for item in batch):
            return None
        size = bucket_for(sum(len(item.ids) for item in batch), self.steps)
        if size is None:
            return None
        step = self.steps[size]
        step.fill(batch, choosers, self.scratch_block, self.runner.sampler)
        step.graph.replay()
        ids = step.out.tolist()
        return [ids[end - 1] for end in itertools.accumulate(len(item.ids) for item in batch)]


def one_line(error: BaseException) -> str:
    """``Type: first line of the message``: what a warning says of an error, in one line."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


# The CUDA-only pieces, module attributes so a CPU test can stand in for them.
def capturable(device: torch.device) -> bool:
    """Whether decode graphs can be captured on ``device`` (CUDA graphs: CUDA only)."""
    return device.type == "cuda"


def _reserved_bytes(device: torch.device) -> int:
    return torch.cuda.memory_reserved(device)


def _release_cached(device: torch.device) -> None:
    """Free the allocator's unused cache now, as ``torch.cuda.graph`` does when a capture
    starts: otherwise what that frees (other engines' memory, gone since) is subtracted from
    the graph's bytes (seen on an H200: a test run measured -116 GB of graphs)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _capture(runner, step: StaticDecode) -> None:
    step.graph, step.out = capture_graph(lambda: runner.decode(*step.inputs()))


def capture_graph(call):
    """``call`` captured as a CUDA graph: run twice on a side stream first (the
    allocator and any lazy init, a compile included), then captured. Returns (the graph, the
    output tensor its replays write)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.inference_mode():
        for _ in range(2):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.inference_mode():
        out = call()
    return graph, out
