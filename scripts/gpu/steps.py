"""The steps of ``scripts.gpu_check``, each a function that fills a dict of figures.

A step runs in its own process (scripts.gpu_check isolates them), on CUDA or, with
``--device cpu``, on the CPU with the same code at a shrunk size (no graph capture there: the
captured call is replayed eagerly), so only CUDA-specific failures are left for a GPU machine.
Figures are written as they are found (``Figures``): a step cut off by its time budget still
reports what it measured (docs/testing.md §GPU check).
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import platform
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
import traceback
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch
from torch.autograd import DeviceType

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "llava-1.5-7b-hf"
DEMO_MODEL = REPO / "models" / "demo-llava"
QUESTIONS = ["What is in the picture?", "Describe it in more detail.", "And the colours?"]
MiB, GiB = 1 << 20, 1 << 30
# The 7B's shape on the CPU (--device cpu): the same code at a size two cores run in seconds.
SHRUNK_TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16}  # fmt: skip
SHRUNK_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                 "num_attention_heads": 2}  # fmt: skip


class Figures(dict):
    """A step's figures, each also written to ``path`` as soon as it is set."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    def __setitem__(self, key: str, value) -> None:
        super().__setitem__(key, value)
        self.path.write_text(json.dumps(self, default=str))


@dataclass(frozen=True)
class Plan:
    """What a run measures: the GPU's sizes, or the CPU's shrunk ones."""

    device: torch.device
    sessions: tuple[int, ...]
    new_tokens: int
    turn_tokens: int  # tokens of each of the 9 turns before turn 10
    decode_tokens: int  # tokens of each of the 3 answers timed at one session
    history: int  # tokens of the session restored from the host tier
    shard_sessions: int
    rounds: int

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.cuda else torch.float32

    @classmethod
    def for_device(cls, device: str, args: argparse.Namespace) -> Plan:
        if device == "cpu":
            return cls(torch.device("cpu"), sessions=(2, 4), new_tokens=8, turn_tokens=4,
                       decode_tokens=16, history=700, shard_sessions=4, rounds=3)  # fmt: skip
        return cls(torch.device("cuda", torch.cuda.current_device()), sessions=tuple(args.sessions),
                   new_tokens=args.new_tokens, turn_tokens=32, decode_tokens=128, history=2000,
                   shard_sessions=args.shard_sessions, rounds=7)  # fmt: skip


def device_name(plan: Plan) -> str:
    return torch.cuda.get_device_name(plan.device) if plan.cuda else "cpu"


def sync(plan: Plan) -> None:
    if plan.cuda:
        torch.cuda.synchronize(plan.device)


# -- preflight ------------------------------------------------------------------------------
def preflight(plan: Plan, figures: Figures) -> None:
    """Versions, what Triton needs to compile, one compile of the paged call at the 7B's
    attention shape checked against SDPA, one graph capture and replay of it."""
    from scripts.bench.attention import FLEX, LOOP, candidates

    figures["python"] = platform.python_version()
    figures["torch"] = torch.__version__
    for package in ("transformers", "triton", "pytest"):
        figures[package] = _version(package)
    figures["cuda"] = torch.version.cuda
    figures["c_compiler"] = shutil.which("gcc") or shutil.which("cc")  # Triton builds with it
    figures["python_h"] = Path(sysconfig.get_paths()["include"], "Python.h").exists()
    if plan.cuda:
        properties = torch.cuda.get_device_properties(plan.device)
        figures["capability"] = f"{properties.major}.{properties.minor}"
        figures["memory_gib"] = round(properties.total_memory / GiB, 1)
        figures["driver"] = _driver()
    shape = argparse.Namespace(batch=8 if plan.cuda else 2, context=650 if plan.cuda else 40,
                               heads=32, kv_heads=32, head_dim=128, block_tokens=16)  # fmt: skip
    with torch.inference_mode():
        runs = candidates(shape, plan.device, plan.dtype)
        expected = runs[LOOP]()
        start = time.perf_counter()
        compiled = runs[FLEX]()
        sync(plan)
        figures["paged_compile_s"] = round(time.perf_counter() - start, 2)
        figures["paged_vs_sdpa_max_diff"] = _diff(compiled, expected)
        start = time.perf_counter()
        replayed = _capture_and_replay(runs[FLEX], plan)
        figures["graph_capture_s"] = round(time.perf_counter() - start, 2)
        figures["graph_vs_eager_max_diff"] = _diff(replayed, compiled)
    tolerance = 2e-2 if plan.dtype == torch.bfloat16 else 1e-4
    if figures["paged_vs_sdpa_max_diff"] > tolerance:
        raise AssertionError(f"the compiled paged call differs from SDPA by more than {tolerance}")
    if figures["graph_vs_eager_max_diff"] != 0:
        raise AssertionError("the replayed graph differs from the eager call")


def _capture_and_replay(call, plan: Plan) -> torch.Tensor:
    """``call`` captured in a CUDA graph as the engine captures its decode steps, and
    replayed; on the CPU, called again."""
    from llava.exec.graphs import capture_graph

    if not plan.cuda:
        return call()
    graph, out = capture_graph(call)
    graph.replay()
    sync(plan)
    return out


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _driver() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    done = subprocess.run(query, capture_output=True, text=True, timeout=20)
    return done.stdout.strip() or None


# -- attention ------------------------------------------------------------------------------
def attention(plan: Plan, figures: Figures) -> None:
    """One layer's decode attention candidates at the 7B's shape (scripts/bench/attention.py):
    each one's median ms at 1 and 32 rows of 650 tokens, and which was fastest."""
    from scripts.bench.attention import DENSE, measure

    for batch in (1, 32) if plan.cuda else (1, 4):
        shape = argparse.Namespace(batch=batch, context=650 if plan.cuda else 64, heads=32,
                                   kv_heads=32, head_dim=128, block_tokens=16,
                                   rounds=plan.rounds)  # fmt: skip
        with torch.inference_mode():
            table = measure(shape, plan.device, plan.dtype)
        times = {}
        diffs = {}
        for name, (runs, diff) in table.items():
            times[name] = round(statistics.median(runs) * 1e3, 3) if runs else f"n/a: {diff}"
            diffs[name] = diff if runs else None
            print(f"{batch:>3} rows  {name:<28} {times[name]}  max |diff| {diffs[name]}")
        figures[f"ms_{batch}_rows"] = times
        figures[f"max_diff_{batch}_rows"] = diffs
        measured = {name: ms for name, ms in times.items()
                    if isinstance(ms, float) and name != DENSE}  # fmt: skip
        figures[f"fastest_{batch}_rows"] = min(measured, key=measured.get)


# -- table ----------------------------------------------------------------------------------
def random_7b(plan: Plan):
    """llava-1.5-7b's exact shape with random weights (shrunk on the CPU), loaded as the
    engine loads a checkpoint: its real tokenizer, processor and chat template."""
    from transformers import LlavaConfig

    from llava.model.checkpoint import inspect_checkpoint
    from llava.model.loading import LoadedModel

    checkpoint = inspect_checkpoint(FIXTURE)  # the engine's own checks, its processor and ids
    values = json.loads((FIXTURE / "config.json").read_text())
    if not plan.cuda:
        values["text_config"].update(SHRUNK_TEXT)
        values["vision_config"].update(SHRUNK_VISION)
    dtype = str(plan.dtype).removeprefix("torch.")
    for part in (values, values["text_config"], values["vision_config"]):
        part.pop("torch_dtype", None)  # the checkpoint's float16 would win over ours
        part["dtype"] = dtype
    config = LlavaConfig.from_dict(values)
    torch.manual_seed(0)
    with plan.device:
        # transformers 5.17 builds the projector in float32 whatever the config says
        model = checkpoint.model_class(config).to(plan.dtype).eval()
    return LoadedModel(
        model=model,
        processor=checkpoint.processor,
        prompt=checkpoint.prompt,
        device=plan.device,
        dtype=plan.dtype,
        eos_token_ids=checkpoint.eos_token_ids,
        max_positions=config.text_config.max_position_embeddings,
        image_aspect_ratio=checkpoint.image_aspect_ratio,
    )


def built_7b(plan: Plan, figures: Figures):
    """``random_7b``, its weights' size and build time in ``figures``."""
    start = time.perf_counter()
    loaded = random_7b(plan)
    figures["weights_gib"] = round(_weight_bytes(loaded) / GiB, 2)
    figures["build_s"] = round(time.perf_counter() - start, 1)
    return loaded


def _weight_bytes(loaded) -> int:
    return sum(p.numel() * p.element_size() for p in loaded.model.parameters())


def engine_over(loaded, plan: Plan, figures: Figures, sessions: int, pool_bytes: int | None = None):
    """The engine over ``loaded`` as it is served on a GPU (the engine's own budget rule, or a
    pool of ``pool_bytes``, and its own attention choice) for ``sessions`` at once; on the CPU
    a bounded pool, and the paged flex path CUDA takes rather than the CPU's own choice. The
    caller stops it."""
    from llava.config import EngineConfig
    from llava.engine import Engine
    from llava.kv.budget import memory_budget

    # Nothing shared: the stateless and recompute baselines compute everything again.
    if plan.cuda:
        config = EngineConfig(model_dir=str(FIXTURE), session_budget_bytes=pool_bytes,
                              prefix_sharing="off")  # fmt: skip
    else:
        config = EngineConfig(model_dir=str(FIXTURE), session_budget_bytes=pool_bytes or 256 * MiB,
                              attention="flex", prefix_sharing="off")  # fmt: skip
    budget = memory_budget(config, plan.device)
    engine = Engine(loaded, replace(config, max_batch=sessions), budget)
    figures["pool_gib"] = round(engine.memory.pool.allocated_bytes / GiB, 2)
    return engine


def served_7b(plan: Plan, figures: Figures):
    """The engine over ``random_7b`` as it is served (``engine_over``) for the plan's largest
    session count. Returns (engine, bytes of weights); the caller stops the engine."""
    loaded = built_7b(plan, figures)
    return engine_over(loaded, plan, figures, max(plan.sessions)), _weight_bytes(loaded)


def table(plan: Plan, figures: Figures) -> None:
    """The engine on the 7B shape: graph capture, an open, decode at 1 session, turn-10 TTFT
    with KV against re-prefilling, tokens/s at each session count, restore from the host tier
    against recompute, allocator-reserved against accounted bytes."""
    engine, weights = served_7b(plan, figures)
    try:
        with torch.inference_mode():
            _engine_figures(engine, plan, figures, weights)
    finally:
        engine.stop()


def _engine_figures(engine, plan: Plan, figures: Figures, weights: int) -> None:
    from demo_model.synthetic import held_out_samples
    from llava.kv.holding import Tier
    from scripts.bench.concurrency import sessions_at_once
    from scripts.bench.memory import grown_session, turn_latency

    figures["warm_up_s"] = round(engine.warm_up(), 1)
    figures["attention_path"] = engine.runner.attention
    graphs = engine.runner.graphs
    if graphs is not None:
        figures["graph_buckets"] = sorted(graphs.steps)
        figures["capture_s"] = round(graphs.capture_s, 1)
        figures["graphs_mib"] = round(graphs.reserved_bytes / MiB)
    memory = partial(_memory_after, engine, plan, figures, weights)
    memory("warm_up")
    images = [s.image for s in held_out_samples(max(plan.sessions), seed=80_000)]

    _open_figures(engine, figures)
    figures["decode_ms_per_token_1"], _ids = decode_ms_per_token(engine, images[0], plan)
    memory("decode")

    # Turn 10 with the session's KV, then the same turn after dropping the KV: re-prefilling
    # the whole conversation from the features, as a stateless server would every turn.
    session = engine.open(images[0]).session_id
    turn = {"max_new_tokens": plan.turn_tokens, "min_new_tokens": plan.turn_tokens}
    for index in range(9):
        engine.ask(session, QUESTIONS[index % 3], turn)
    forced = {"max_new_tokens": plan.new_tokens, "min_new_tokens": plan.new_tokens}
    with_kv = engine.ask(session, QUESTIONS[0], forced)
    engine.memory.drop_kv(engine.store.session(session).holding)
    again = engine.ask(session, QUESTIONS[0], forced)
    assert again.tier is Tier.FEATURES, again.tier
    engine.close(session)
    figures["ttft_turn10_kv_ms"] = round(with_kv.ttft_s * 1e3, 1)
    figures["ttft_turn10_stateless_ms"] = round(again.ttft_s * 1e3, 1)
    figures["turn10_prefill_tokens"] = again.new_tokens
    figures["ttft_turn10_stateless_over_kv"] = round(again.ttft_s / with_kv.ttft_s, 2)
    memory("turn10")

    for n in plan.sessions:
        run = sessions_at_once(engine, images[:n], 2, plan.new_tokens)
        figures[f"tokens_per_s_{n}"] = round(run.tokens_per_s, 1)
        figures[f"ttft_p50_ms_{n}"] = round(statistics.median(run.ttft_s) * 1e3, 1)
        memory(f"sessions_{n}")

    session = grown_session(engine, images[0], plan.history)
    figures["restore_history_tokens"] = len(engine.store.session(session).token_ids)
    ttft = {}
    for tier in (Tier.HOST, Tier.FEATURES):
        seen = [turn_latency(engine, session, tier, 1) for _ in range(3)]
        assert all(found is tier for _t, _total, found in seen), seen
        ttft[tier] = statistics.median(t for t, _total, _found in seen)
    engine.close(session)
    figures["restore_host_ttft_ms"] = round(ttft[Tier.HOST] * 1e3, 1)
    figures["recompute_ttft_ms"] = round(ttft[Tier.FEATURES] * 1e3, 1)
    figures["recompute_over_restore"] = round(ttft[Tier.FEATURES] / ttft[Tier.HOST], 2)
    memory("restore")


def _open_figures(engine, figures: Figures) -> None:
    """An open on llava-1.5 (the vision tower, the opening's prefill: its 576 image tokens and
    the template's), the image decoded already: the median of 3 on different images, each
    session closed after. An open returns once its prefill's next id reached the host: the
    device's work is done by then."""
    from demo_model.synthetic import held_out_samples

    seconds = []
    for sample in held_out_samples(3, seed=80_100):
        start = time.perf_counter()
        session = engine.open(sample.image).session_id
        seconds.append(time.perf_counter() - start)
        figures["open_prefill_tokens"] = len(engine.store.session(session).token_ids)
        engine.close(session)
    figures["open_ms"] = round(statistics.median(seconds) * 1e3, 1)


def decode_ms_per_token(engine, image, plan: Plan) -> tuple[float, list[int]]:
    """Decode ms/token at one session: 3 answers of ``plan.decode_tokens`` forced tokens in one
    session, each one's time past its first token over the tokens after it; their median, and
    the first answer's ids (greedy: a one-turn prompt's answer)."""
    session = engine.open(image).session_id
    forced = {"max_new_tokens": plan.decode_tokens, "min_new_tokens": plan.decode_tokens}
    answers = [engine.ask(session, QUESTIONS[1], forced) for _ in range(3)]
    engine.close(session)
    per_token = [(a.total_s - a.ttft_s) / (len(a.token_ids) - 1) for a in answers]
    return round(statistics.median(per_token) * 1e3, 2), list(answers[0].token_ids)


def _memory_after(engine, plan: Plan, figures: Figures, weights: int, phase: str) -> None:
    """Allocator-reserved against accounted bytes (weights, pool, captured graphs) after a
    phase of the table; ``reserved_over_accounted`` keeps the largest ratio so far."""
    graphs = engine.runner.graphs
    graph_bytes = graphs.reserved_bytes if graphs is not None else 0
    accounted = weights + engine.memory.pool.allocated_bytes + graph_bytes
    figures["accounted_gib"] = round(accounted / GiB, 2)
    if plan.cuda:
        reserved = torch.cuda.memory_reserved(plan.device)
        ratio = round(reserved / accounted, 3)
        figures[f"reserved_gib_after_{phase}"] = round(reserved / GiB, 2)
        figures[f"reserved_over_accounted_after_{phase}"] = ratio
        figures["reserved_over_accounted"] = max(ratio, figures.get("reserved_over_accounted", 0))


# -- profile --------------------------------------------------------------------------------
def profile(plan: Plan, figures: Figures) -> None:
    """Where a turn's decode time goes on the served 7B, at 1 session and at the largest count:
    wall ms per step (a turn of every session, unprofiled) against the device's kernel ms per
    step, kernel launches, graph replays, copies and syncs per step, and the kernels and host
    ops that took the most (torch.profiler over the next turn; sessions opened and warmed
    first): what a missed speed target needs to be fixed within a GPU lease."""
    from concurrent.futures import ThreadPoolExecutor

    from demo_model.synthetic import held_out_samples

    engine, _weights = served_7b(plan, figures)
    tokens = plan.new_tokens
    forced = {"max_new_tokens": tokens, "min_new_tokens": tokens}

    def turn_of_each(pool, ids: list[str], question: str) -> None:
        list(pool.map(lambda session_id: engine.ask(session_id, question, forced), ids))

    try:
        with torch.inference_mode():
            engine.warm_up()
            for n in sorted({1, max(plan.sessions)}):
                images = [s.image for s in held_out_samples(n, seed=82_000)]
                ids = [engine.open(image).session_id for image in images]
                with ThreadPoolExecutor(n) as pool:
                    turn_of_each(pool, ids, QUESTIONS[0])  # warm
                    start = time.perf_counter()
                    turn_of_each(pool, ids, QUESTIONS[2])
                    plain = time.perf_counter() - start
                    run, wall = _profiled(
                        engine, plan, partial(turn_of_each, pool, ids, QUESTIONS[1])
                    )
                for session_id in ids:
                    engine.close(session_id)
                where = _where_time_went(run.key_averages(), wall, tokens)
                figures[f"sessions_{n}"] = {"wall_ms_per_step": round(plain * 1e3 / tokens, 2),
                                            **where}  # fmt: skip
            figures["prefill_turn"] = _profiled_prefill(engine, plan)
    finally:
        engine.stop()


def _profiled_prefill(engine, plan: Plan) -> dict:
    """A turn's prefill alone (one new token) on a session with some history, profiled as
    the decode steps are: what the time to first token of a turn with the session's KV pays."""
    from demo_model.synthetic import held_out_samples

    one_token = {"max_new_tokens": 1, "min_new_tokens": 1}
    session = engine.open(held_out_samples(1, seed=83_000)[0].image).session_id
    for question in QUESTIONS:  # history, and the prefill path warm
        engine.ask(session, question, one_token)
    start = time.perf_counter()
    plain = engine.ask(session, QUESTIONS[0], one_token)
    plain_s = time.perf_counter() - start
    answers = []
    run, wall = _profiled(
        engine, plan, lambda: answers.append(engine.ask(session, QUESTIONS[1], one_token))
    )
    engine.close(session)
    where = _where_time_went(run.key_averages(), wall, 1)
    return {"new_tokens": answers[0].new_tokens, "ttft_ms": round(plain.ttft_s * 1e3, 2),
            "turn_ms": round(plain_s * 1e3, 2), **where}  # fmt: skip


def _profiled(engine, plan: Plan, work) -> tuple:
    """``work()`` under torch.profiler: (the profile, wall seconds to the device's end). The
    profiler starts and stops in the engine loop's thread, so the host ops of the steps are
    recorded in the thread that runs them."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if plan.cuda else [])
    run = profiler(activities=activities)
    start = time.perf_counter()
    engine.loop.call(run.__enter__)
    work()
    sync(plan)
    wall = time.perf_counter() - start
    engine.loop.call(partial(run.__exit__, None, None, None))
    return run, wall


def _where_time_went(averages, wall_s: float, steps: int) -> dict:
    """Per decode step (``steps``: the tokens each session generated, one step each), from a
    profile's ``key_averages()``; the profiler's own cost is in its wall time, not in the
    kernels' device time. Kernel time is the device's own rows alone (kernels, and the copies
    and fills it ran): a host op's row carries the device time of the kernels it launched, so
    counting it too would count those kernels twice."""
    kernels = [a for a in averages if a.device_type != DeviceType.CPU and a.self_device_time_total]
    host = sorted(averages, key=lambda a: a.self_cpu_time_total, reverse=True)

    def per_step(*prefixes: str) -> float:
        return round(sum(a.count for a in averages if a.key.startswith(prefixes)) / steps, 1)

    return {
        "profiled_wall_ms_per_step": round(wall_s * 1e3 / steps, 2),
        "kernel_ms_per_step": round(
            sum(a.self_device_time_total for a in kernels) / 1e3 / steps, 2
        ),
        "kernels_per_step": round(sum(a.count for a in kernels) / steps, 1),
        "graph_launches_per_step": per_step("cudaGraphLaunch"),
        # every launch call: cudaLaunchKernel, cudaLaunchKernelExC, Triton's cuLaunchKernelEx
        "kernel_launches_per_step": per_step("cudaLaunchKernel", "cuLaunchKernel"),
        "copies_per_step": per_step("cudaMemcpyAsync"),
        "syncs_per_step": per_step("cudaStreamSynchronize"),
        "top_kernels_ms_per_step": {
            a.key[:70]: round(a.self_device_time_total / 1e3 / steps, 3)
            for a in sorted(kernels, key=lambda a: a.self_device_time_total, reverse=True)[:8]
        },
        "top_host_ms_per_step": {
            a.key[:70]: round(a.self_cpu_time_total / 1e3 / steps, 3) for a in host[:8]
        },
    }


# -- compile --------------------------------------------------------------------------------
def whole_step_compile(plan: Plan, figures: Figures) -> None:
    """The served 7B's decode step at one row compiled whole by inductor (``fullgraph=True``,
    as scripts/gpu/compiled_decode.py compiles it before its capture): the compile's seconds,
    and its ids and ms a step against the eager step's. ``compile_threads = 1`` compiles in
    this process, so a failure raises its own error, not a compile worker's
    ``SubprocException`` whose first line says nothing. On the CPU the step is traced whole
    and run by the eager backend, as tests/unit/test_graphs.py compiles it: inductor's CPU
    lowering of flex attention inside a larger graph finds no kernel (NoValidChoicesError)."""
    from torch._inductor import config as inductor

    inductor.compile_threads = 1
    engine, _weights = served_7b(plan, figures)
    try:
        with torch.inference_mode():
            _compiled_step_figures(engine.runner, plan, figures)
    finally:
        engine.stop()


def _compiled_step_figures(runner, plan: Plan, figures: Figures) -> None:
    from llava.exec.graphs import StaticDecode

    step = StaticDecode.empty(1, runner.pool_slots // runner.pool.block_tokens, plan.device)
    step.tables.fill_(runner.pool.set_aside())  # the row writes its K/V where no session is
    figures["attention_path"] = runner.attention  # the paged call the step makes (no warm-up)
    figures["backend"] = "inductor" if plan.cuda else "aot_eager"
    compiled = torch.compile(runner.decode, fullgraph=True, dynamic=False,
                             backend=figures["backend"])  # fmt: skip
    start = time.perf_counter()
    ids = compiled(*step.inputs())
    sync(plan)
    figures["compile_s"] = round(time.perf_counter() - start, 1)
    figures["ids_equal_eager"] = torch.equal(ids, runner.decode(*step.inputs()))
    reps = 5 if plan.cuda else 1  # the CPU's eager backend runs flex eagerly: seconds a step
    for name, call in (("eager", runner.decode), ("compiled", compiled)):
        seconds = _median_wall_s(plan, call, step.inputs(), reps)
        figures[f"{name}_step_ms"] = round(seconds * 1e3, 2)


def _median_wall_s(plan: Plan, call, inputs: tuple, reps: int) -> float:
    times = []
    for _ in range(reps):
        sync(plan)
        start = time.perf_counter()
        call(*inputs)
        sync(plan)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# -- hf_generate ----------------------------------------------------------------------------
# One session's pool in hf_generate: the engine's default takes most of the free memory.
HF_STEP_POOL = 4 * GiB
HF_VARIANTS = ("eager", "static", "compiled")
STATIC = {"cache_implementation": "static"}
FIRST_TOKENS = 8  # the greedy ids compared between transformers' generate and ours


def hf_generate(plan: Plan, figures: Figures) -> None:
    """transformers' own ``generate`` against the engine at one session, on one random 7B
    (the same weights) in one process: HF's decode ms/token eager (its dynamic cache), with a
    static cache, then ours (the engine as served, a bounded pool), then HF's static cache
    with its forward compiled, last: a compile that overruns the budget costs that figure
    alone. A variant that raises writes ``hf_<variant>_error`` and the next runs. Greedy,
    the engine's banned ids suppressed, one real llava-1.5 prompt with one image."""
    from torch._inductor import config as inductor

    from demo_model.synthetic import held_out_samples

    inductor.compile_threads = 1  # a failed compile raises its own error, in this process
    loaded = built_7b(plan, figures)
    image = held_out_samples(1, seed=84_000)[0].image
    measure = partial(_hf_ms_per_token, loaded, _hf_inputs(loaded, image), plan)
    answers = [
        _hf_variant(figures, "eager", measure),
        _hf_variant(figures, "static", measure, disable_compile=True, **STATIC),
    ]
    _free_cached(plan)  # HF's caches, before our pool is sized
    ours = _ours_at_one_session(loaded, image, plan, figures)
    hf = next(filter(None, answers), None)
    if hf is not None:  # fp32 on the CPU: token-equal; bf16 on a GPU may differ
        figures["first_tokens_equal"] = ours[:FIRST_TOKENS] == hf[:FIRST_TOKENS]
    _ours_over_hf(figures)
    _free_cached(plan)
    _hf_variant(figures, "compiled", measure, compile_config=_compile_config(plan), **STATIC)
    # generate made its compiled forward (else the figure is its eager static one again)
    figures["hf_compiled_forward"] = "_compiled_call" in vars(loaded.model)
    _ours_over_hf(figures)


def _ours_at_one_session(loaded, image, plan: Plan, figures: Figures) -> list[int]:
    """Our decode ms/token at one session on ``loaded`` (as the table measures it), the engine
    warmed up and its graphs captured as served, on a pool that one session fits; returns the
    first answer's ids."""
    pool_bytes = HF_STEP_POOL if plan.cuda else None
    engine = engine_over(loaded, plan, figures, sessions=1, pool_bytes=pool_bytes)
    try:
        with torch.inference_mode():
            figures["warm_up_s"] = round(engine.warm_up(), 1)
            figures["ours_ms_per_token_1"], ids = decode_ms_per_token(engine, image, plan)
    finally:
        engine.stop()
    return ids


def _hf_inputs(loaded, image) -> dict:
    """The engine's own first-turn prompt (its template, the image expanded to its tokens)
    and pixels (its preprocessing), as ``generate`` takes them."""
    from llava.model.prompt import user_message
    from llava.model.vision import image_tokens_of, vision_inputs

    processor = loaded.processor
    tokens = image_tokens_of(image, processor, loaded.image_aspect_ratio)
    ids = loaded.prompt.ids([user_message(QUESTIONS[1], 1)], tokens)
    pixels = vision_inputs(image, processor.image_processor, loaded.image_aspect_ratio)
    return {"input_ids": torch.tensor([ids], device=loaded.device),
            "pixel_values": pixels["pixel_values"].to(loaded.device, loaded.dtype)}  # fmt: skip


def _hf_ms_per_token(loaded, inputs: dict, plan: Plan, **options) -> tuple[float, float, list]:
    """HF's decode ms/token at batch 1: (time of N new tokens - time of 1) / (N - 1), the
    median of 3, after a first call of N (a compile, a graph capture); returns (that first
    call's seconds, ms/token, its greedy ids)."""
    from llava.sampling.logits_mask import banned_token_ids

    vocab = loaded.model.config.text_config.vocab_size
    banned = banned_token_ids(loaded.tokenizer, vocab, loaded.eos_token_ids)
    prompt = inputs["input_ids"].shape[1]

    def timed(tokens: int) -> tuple[float, torch.Tensor]:
        sync(plan)
        start = time.perf_counter()
        out = loaded.model.generate(**inputs, do_sample=False, max_new_tokens=tokens,
                                    min_new_tokens=tokens, suppress_tokens=banned,
                                    **options)  # fmt: skip
        sync(plan)
        return time.perf_counter() - start, out

    n = plan.decode_tokens
    first_s, out = timed(n)
    per_token = [(timed(n)[0] - timed(1)[0]) / (n - 1) for _ in range(3)]
    ms = round(statistics.median(per_token) * 1e3, 2)
    return round(first_s, 1), ms, out[0, prompt:].tolist()


def _hf_variant(figures: Figures, variant: str, measure, **options) -> list[int] | None:
    """``measure(**options)``'s figures as ``hf_<variant>_...`` and its greedy ids; or, if it
    raises, its error's first line as ``hf_<variant>_error`` and None."""
    from scripts.gpu.check import error_line

    try:
        first_s, ms, ids = measure(**options)
    except Exception as error:
        traceback.print_exc()
        figures[f"hf_{variant}_error"] = error_line(error)
        return None
    figures[f"hf_{variant}_first_call_s"] = first_s
    figures[f"hf_{variant}_ms_per_token"] = ms
    return ids


def _compile_config(plan: Plan):
    """None on CUDA: with a static cache ``generate`` compiles its forward itself (inductor,
    reduce-overhead). Elsewhere it does not unless told to (``_compile_all_devices``,
    transformers' own switch for tests); on the CPU traced by dynamo and run by aot_eager, as
    the compile step does there: the path is what a CPU run proves, not the speed."""
    from transformers import CompileConfig

    if plan.cuda:
        return None
    config = CompileConfig(backend="aot_eager", mode="default")
    config._compile_all_devices = True
    return config


def _ours_over_hf(figures: Figures) -> None:
    """Ours against the fastest HF variant measured so far (``hf_best``)."""
    measured = {variant: figures[f"hf_{variant}_ms_per_token"]
                for variant in HF_VARIANTS
                if f"hf_{variant}_ms_per_token" in figures}  # fmt: skip
    if measured and "ours_ms_per_token_1" in figures:
        figures["hf_best"] = min(measured, key=measured.get)
        ratio = figures["ours_ms_per_token_1"] / measured[figures["hf_best"]]
        figures["ours_over_hf"] = round(ratio, 3)


def _free_cached(plan: Plan) -> None:
    gc.collect()
    if plan.cuda:
        torch.cuda.empty_cache()


# -- tests ----------------------------------------------------------------------------------
def cuda_test_files() -> list[str]:
    """Every unit-test file with a test marked ``gpu`` (it needs CUDA). Named rather than the
    whole tier, so that no module needing boto3, moto or TorchServe is collected on a GPU
    machine that has none of them; found rather than listed, so that none is left out."""
    found = (REPO / "tests" / "unit").glob("test_*.py")
    return sorted(str(p.relative_to(REPO)) for p in found if "pytest.mark.gpu" in p.read_text())


def tests(plan: Plan, figures: Figures) -> None:
    """Every CUDA test (``pytest -m gpu`` over ``cuda_test_files``): ok when at least one
    passed and none failed. On the CPU every one skips, which checks that they are collected."""
    figures["files"] = cuda_test_files()
    # no log capture: torch's compile logs at DEBUG would bury a failure's own lines
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
               "-p", "no:logging", "--tb=short", *figures["files"]]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    print(done.stdout[-20_000:], done.stderr[-3000:], sep="\n")
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    figures["summary"] = summary
    counts = outcome_counts(summary)
    for word, count in counts.items():
        figures[word] = count
    problem = cuda_tests_problem(counts, plan.cuda)
    if problem is None and done.returncode != 0:
        problem = f"pytest exited {done.returncode}"
    if problem:
        raise AssertionError(f"{problem}: {summary}")


def outcome_counts(summary: str) -> dict[str, int]:
    """pytest's closing line as counts: passed, failed, skipped, errors (those present)."""
    counts = {}
    for number, word in re.findall(r"(\d+) (\w+)", summary):
        word = "errors" if word == "error" else word
        if word in ("passed", "failed", "skipped", "errors"):
            counts[word] = int(number)
    return counts


def cuda_tests_problem(counts: dict[str, int], cuda: bool) -> str | None:
    """Why a run of the CUDA tests does not count as passing, None when it does: none may fail
    or error, and on CUDA at least one must pass (nothing collected, or every test skipped,
    is a failure there); on the CPU, where each one skips, at least one must be skipped."""
    broken = counts.get("failed", 0) + counts.get("errors", 0)
    if broken:
        return f"{broken} CUDA tests failed or errored"
    needed = "passed" if cuda else "skipped"
    if not counts.get(needed):
        return f"no CUDA test {needed}"
    return None


# -- shards ---------------------------------------------------------------------------------
def shards(plan: Plan, figures: Figures) -> None:
    """Two engine shards of the demo model on the one device, both at once."""
    devices = f"{plan.device},{plan.device}"
    figures["devices"] = devices
    tokens_per_s, rows = shard_table(devices, plan.shard_sessions, plan.new_tokens, 256 * MiB)
    figures["tokens_per_s"] = round(tokens_per_s, 1)
    figures["sessions_by_shard"] = [sessions for _device, sessions, _tokens in rows]


def shard_table(
    devices: str, sessions: int, new_tokens: int, session_budget_bytes: int
) -> tuple[float, list[tuple[str, int, int]]]:
    """Engine shards on ``devices`` as a worker builds them (llava.shards), the demo model's
    sessions at once: tokens/s over the run's one wall clock, and each shard's (device,
    sessions placed there, tokens it answered); printed as a table too. A bounded pool: the
    device's default share would give the demo model millions of blocks."""
    from demo_model.synthetic import held_out_samples
    from llava.config import EngineConfig
    from llava.shards import ShardedEngine
    from scripts.bench.concurrency import sessions_at_once

    config = EngineConfig(
        model_dir=str(DEMO_MODEL), device=devices, session_budget_bytes=session_budget_bytes
    )
    sharded = ShardedEngine.from_config(config)
    try:
        sharded.warm_up()
        images = [s.image for s in held_out_samples(sessions, seed=81_000)]
        run = sessions_at_once(sharded, images, 2, new_tokens)
    finally:
        sharded.stop()
    rows = []
    for index, engine in enumerate(sharded.shards):
        mine = [s for s in run.tokens_by_session if sharded.shard_of(s) == index]
        tokens = sum(run.tokens_by_session[s] for s in mine)
        rows.append((str(engine.loaded.device), len(mine), tokens))
    print(f"engine shards on {devices} (demo model): {sessions} sessions at once, 2 turns of "
          f"{new_tokens} tokens; {run.tokens_per_s:.1f} tokens/s in all")  # fmt: skip
    print(f"{'shard':>5} {'device':>8} {'sessions':>8} {'tokens':>7} {'tokens/s':>9}")
    for index, (device, placed, tokens) in enumerate(rows):
        print(f"{index:>5} {device:>8} {placed:>8} {tokens:>7} {tokens / run.wall_s:>9.1f}")
    return run.tokens_per_s, rows


STEPS = {"preflight": preflight, "attention": attention, "table": table, "tests": tests,
         "shards": shards, "profile": profile, "compile": whole_step_compile,
         "hf_generate": hf_generate}  # fmt: skip
