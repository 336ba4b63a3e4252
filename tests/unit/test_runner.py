"""The packed step runner against the model's own forward (fp32, CPU).

Oracle: ``model(ids, past_key_values=DynamicCache)`` through ``llava.sampling.chooser.prefill``, the
call the engine made before the runner existed. Models: the committed demo model, and a tiny
random LLaVA built from llava-1.5-7b-hf's own config (shrunk, with grouped KV heads and random
biases so those paths count) driven by the checkpoint's real tokenizer and processor.
"""

from __future__ import annotations

import json
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, DynamicCache, LlavaConfig, LlavaForConditionalGeneration

import llava.exec.runner
import llava.exec.triton_decode
from demo_model.evaluation import QUESTIONS
from demo_model.synthetic import held_out_samples
from llava.config import SettingsError
from llava.exec.runner import PagedAttentionFailed, Runner, RunnerCounters, StepInput
from llava.exec.step_meta import _slots
from llava.kv.pool import KVPool
from llava.model.prompt import ChatPrompt, user_message
from llava.model.reference import prefill

LLAVA_15 = Path(__file__).resolve().parents[1] / "fixtures" / "llava-1.5-7b-hf"
TINY_IMAGE_PX = 56  # 16 image tokens of 14 px patches
BUDGET = 8 << 20


@dataclass(frozen=True)
class Subject:
    """A model under test with what it takes to build real prompts for it."""

    model: LlavaForConditionalGeneration
    prompt: ChatPrompt
    image_processor: object

    def features(self, image: Image.Image) -> torch.Tensor:
        pixels = self.image_processor(images=image, return_tensors="pt").pixel_values
        with torch.inference_mode():
            out = self.model.model.get_image_features(pixel_values=pixels, return_dict=True)
        return out.pooler_output[0]

    def chunks(self, image, questions: list[str]) -> list[tuple[list[int], torch.Tensor | None]]:
        """The opening (with the image's features), then each question's new ids on top."""
        features = None if image is None else self.features(image)
        tokens = 0 if features is None else features.shape[0]
        opening = self.prompt.opening_ids(features is not None, tokens)
        out, history = [(opening, features)], opening
        for turn, question in enumerate(questions):
            message = user_message(question, images=int(features is not None and turn == 0))
            messages = [
                user_message(q, features is not None and i == 0)
                for i, q in enumerate(questions[:turn])
            ]
            ids = self.prompt.ids([*messages, message], tokens)
            out.append((ids[len(history) :], None))
            history = ids
        return out

    def pool(self) -> KVPool:
        return KVPool(self.model.config.text_config, BUDGET, "cpu", torch.float32, block_tokens=16)


# llava-1.5-7b-hf's config shrunk; 2 KV heads for 4 query heads and biases everywhere, so the
# grouped-KV and bias paths are exercised (the 7B has neither).
TINY_TEXT = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "attention_bias": True, "mlp_bias": True,
}  # fmt: skip
TINY_VISION = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
    "num_attention_heads": 2, "image_size": TINY_IMAGE_PX, "projection_dim": 32,
}  # fmt: skip


def tiny_llava(**text) -> Subject:
    raw = json.loads((LLAVA_15 / "config.json").read_text())
    raw["text_config"].update(TINY_TEXT, **text)
    raw["vision_config"].update(TINY_VISION)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(LlavaConfig(**raw)).float().eval()  # config says fp16
    with torch.no_grad():  # initialised to zero: randomise so a missed bias shows
        for module in model.model.language_model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0, 0.5)
    processor = AutoProcessor.from_pretrained(LLAVA_15)
    processor.image_processor.crop_size = {"height": TINY_IMAGE_PX, "width": TINY_IMAGE_PX}
    processor.image_processor.size = {"shortest_edge": TINY_IMAGE_PX}
    return Subject(model, ChatPrompt(processor), processor.image_processor)


@pytest.fixture(scope="module")
def tiny() -> Subject:
    return tiny_llava()


@pytest.fixture(scope="module")
def demo(demo_model) -> Subject:
    return Subject(demo_model.model, demo_model.prompt, demo_model.processor.image_processor)


SUBJECTS = ["tiny-llava-1.5", "demo"]


@pytest.fixture(params=SUBJECTS)
def subject(request) -> Subject:
    return request.getfixturevalue("tiny" if request.param == "tiny-llava-1.5" else "demo")


# -- driving sequences ---------------------------------------------------------------------
Sequence = Generator[StepInput, torch.Tensor, None]


def sequence(pool: KVPool, chunks, decode_steps: int, record: list[torch.Tensor]) -> Sequence:
    """Prefill each chunk, then decode greedily; every step's logits go to ``record``."""
    kv = pool.new_kv()
    for ids, features in chunks:
        kv.reserve(len(ids))
        logits = yield StepInput(kv, ids, features)
        record.append(logits)
    for _ in range(decode_steps):
        kv.reserve(1)
        logits = yield StepInput(kv, [int(logits.argmax())], None)
        record.append(logits)
    kv.free()


def drive(runner: Runner, sequences: list[Sequence], starts: list[int]) -> int:
    """Step every started sequence together until all end; returns the largest batch run."""
    waiting = dict(enumerate(sequences))
    current: dict[int, StepInput] = {}
    widest, step = 0, 0
    while waiting or current:
        for index in [i for i in waiting if starts[i] <= step]:
            current[index] = next(waiting.pop(index))
        if current:
            logits = runner.step(list(current.values()))
            widest = max(widest, len(current))
            for row, index in zip(logits, list(current), strict=True):
                try:
                    current[index] = sequences[index].send(row)
                except StopIteration:
                    del current[index]
        step += 1
    return widest


def hf_record(model, chunks, decode_steps: int) -> list[torch.Tensor]:
    cache, record = DynamicCache(), []
    for ids, features in chunks:
        record.append(prefill(model, ids, cache, features))
    for _ in range(decode_steps):
        record.append(prefill(model, [int(record[-1].argmax())], cache))
    return record


def assert_same_steps(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    assert [int(x.argmax()) for x in got] == [int(x.argmax()) for x in expected]
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"step {step}")


def red_square() -> Image.Image:
    return Image.new("RGB", (80, 50), (200, 40, 90))


# -- equal to the model's forward ----------------------------------------------------------
def fragment(pool: KVPool, run: int = 1) -> None:
    """Leave free only runs of ``run`` blocks, each after a taken one: a session's blocks
    come in runs of at most that many, so the runner joins (``run`` > 1) or gathers (1) its
    KV instead of reading it in place."""
    holders = [pool.new_kv() for _ in range(pool.total_blocks)]
    for holder in holders:
        holder.reserve(pool.block_tokens)
    for index, holder in enumerate(holders):
        if index % (run + 1):
            holder.free()
    assert b"\x01" * (run + 1) not in pool._free_map


@pytest.mark.parametrize(
    ("table", "stop"),
    [([3, 4, 5], 40), ([0, 1, 2, 7, 8], 70), ([0, 1, 2, 7, 8, 3], 90), ([5, 1, 9, 3, 7, 11], 90)],
    ids=["adjacent", "two-runs", "three-runs", "scattered"],
)
def test_a_sequences_slots_are_its_block_tables_positions_however_they_are_read(table, stop):
    slots = _slots(table, torch.tensor(table), stop, 16)
    positions = torch.arange(stop)
    expected = torch.tensor(table)[positions // 16] * 16 + positions % 16
    if isinstance(slots, slice):
        slots = torch.arange(slots.start, slots.stop)
    elif isinstance(slots, tuple):
        slots = torch.cat([torch.arange(run.start, run.stop) for run in slots])
    assert torch.equal(slots, expected)


# flex compiles for seconds on a CPU: the fast loop checks it in test_attention.py alone.
ATTENTION = pytest.mark.parametrize(
    "attention", [pytest.param("flex", marks=pytest.mark.thorough), "sdpa"]
)


# make test-fast keeps three of the twelve, which take each model, each block layout (read in
# place, joined, gathered) and a prompt with and without an image at least once.
FAST_LOGITS = {
    ("tiny-llava-1.5", "image", "fragmented"),
    ("demo", "text-only", "runs"),
    ("demo", "image", "adjacent"),
}
LOGITS_CASES = [
    pytest.param(
        name,
        prompt,
        blocks,
        id=f"{name}-{prompt}-{blocks}",
        marks=() if (name, prompt, blocks) in FAST_LOGITS else pytest.mark.thorough,
    )
    for name in SUBJECTS
    for prompt in ("image", "text-only")
    for blocks in ("adjacent", "runs", "fragmented")
]


@ATTENTION
@pytest.mark.parametrize(("subject", "prompt", "blocks"), LOGITS_CASES, indirect=["subject"])
def test_logits_equal_hf_forward_through_prefills_and_decode(subject, prompt, blocks, attention):
    image = red_square() if prompt == "image" else None
    chunks = subject.chunks(image, [QUESTIONS[0], QUESTIONS[2]])
    expected = hf_record(subject.model, chunks, decode_steps=20)
    got: list[torch.Tensor] = []
    runner = Runner(subject.model, subject.pool(), attention=attention)
    if blocks != "adjacent":
        fragment(runner.pool, run=3 if blocks == "runs" else 1)
    free = runner.pool.free_blocks
    drive(runner, [sequence(runner.pool, chunks, 20, got)], [0])
    assert_same_steps(got, expected)
    assert runner.pool.free_blocks == free


ROPES = {
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32, "rope_theta": 10000.0,
    },
}  # fmt: skip


# the runner takes the model's own rotary embedding for every static rope type: make test-fast
# checks llama3's, make test linear's too
@pytest.mark.parametrize("rope", [pytest.param("linear", marks=pytest.mark.thorough), "llama3"])
def test_scaled_rope_types_equal_hf_forward(rope):
    subject = tiny_llava(rope_parameters=ROPES[rope])
    chunks = subject.chunks(None, [QUESTIONS[1], "And a much longer follow-up question, please."])
    got: list[torch.Tensor] = []
    runner = Runner(subject.model, subject.pool())
    drive(runner, [sequence(runner.pool, chunks, 8, got)], [0])
    assert_same_steps(got, hf_record(subject.model, chunks, 8))


# -- batched equals alone ------------------------------------------------------------------
@ATTENTION
@pytest.mark.parametrize(  # make test-fast: the tiny model's grouped KV heads and biases
    "subject", ["tiny-llava-1.5", pytest.param("demo", marks=pytest.mark.thorough)], indirect=True
)
def test_eight_sequences_stepped_together_equal_each_alone(subject, attention):
    """Different images, text-only sessions, lengths and answer lengths; staggered starts mix
    prefills of some sequences with decode steps of others in one step."""
    samples = held_out_samples(6, seed=31_000)
    images = [s.image for s in samples] + [None, None]
    questions = [
        [QUESTIONS[i % len(QUESTIONS)], QUESTIONS[(i + 2) % len(QUESTIONS)]] for i in range(8)
    ]
    chunks = [
        subject.chunks(image, qs[: 1 + i % 2])
        for i, (image, qs) in enumerate(zip(images, questions, strict=True))
    ]
    decode_steps = [6, 12, 8, 9, 7, 15, 10, 11]
    starts = [0, 0, 1, 1, 2, 2, 3, 3]
    alone: list[list[torch.Tensor]] = []
    runner = Runner(subject.model, subject.pool(), attention=attention)
    for seq_chunks, steps in zip(chunks, decode_steps, strict=True):
        alone.append([])
        drive(runner, [sequence(runner.pool, seq_chunks, steps, alone[-1])], [0])
    together: list[list[torch.Tensor]] = [[] for _ in range(8)]
    sequences = [
        sequence(runner.pool, c, s, r)
        for c, s, r in zip(chunks, decode_steps, together, strict=True)
    ]
    assert drive(runner, sequences, starts) == 8
    for index in range(8):
        assert_same_steps(together[index], alone[index])
    assert runner.pool.free_blocks == runner.pool.total_blocks


# -- cropping and isolation ----------------------------------------------------------------
def test_crop_then_prefill_equals_a_fresh_prefill(demo):
    image = held_out_samples(1, seed=32_000)[0].image
    (opening, features), (question, _) = demo.chunks(image, [QUESTIONS[0]])
    runner = Runner(demo.model, demo.pool())
    kv = runner.pool.new_kv()
    kv.reserve(len(opening) + len(question) + 20)
    runner.step([StepInput(kv, opening, features)])
    runner.step([StepInput(kv, question, None)])
    for token in [7, 9, 11, 13]:  # an answer, later taken back
        runner.step([StepInput(kv, [token], None)])
    keep = len(opening) + 3  # mid-question, mid-block
    kv.crop(keep)
    assert len(kv.blocks) == -(-keep // 16)
    retry = question[3:5] + [12, 30, 8]
    kv.reserve(len(retry))
    after_crop = runner.step([StepInput(kv, retry, None)])
    fresh = runner.pool.new_kv()
    fresh.reserve(keep + len(retry))
    runner.step([StepInput(fresh, opening, features)])
    expected = runner.step([StepInput(fresh, question[:3] + retry, None)])
    torch.testing.assert_close(after_crop, expected, rtol=1e-5, atol=1e-6)


def test_stepping_one_sequence_never_changes_anothers_kv(demo):
    image = held_out_samples(1, seed=33_000)[0].image
    chunks = demo.chunks(image, [QUESTIONS[1]])
    runner = Runner(demo.model, demo.pool())
    other = runner.pool.new_kv()
    other.reserve(40)
    runner.step([StepInput(other, chunks[1][0] * 3, None)])  # 1.5 blocks: a partial block
    slots = torch.tensor([b * 16 + o for b in other.blocks for o in range(16)])
    before = runner.pool.kv[..., slots, :].clone()
    drive(runner, [sequence(runner.pool, chunks, 40, [])], [0])  # crosses several blocks
    assert torch.equal(runner.pool.kv[..., slots, :], before)


# -- attention: the setting's values, and a flex call that fails ---------------------------
def test_attention_takes_the_settings_values(demo):
    runner = Runner(demo.model, demo.pool())
    if demo.model.device.type == "cpu":  # auto is sdpa on CPU: nothing to time
        assert (runner.attention_setting, runner.attention) == ("auto", "sdpa")
        assert runner.settle_attention() is None
    assert Runner(demo.model, demo.pool(), attention="flex").attention == "flex"
    assert Runner(demo.model, demo.pool(), attention="triton").attention == "triton"
    with pytest.raises(ValueError, match="one of auto, flex, triton, sdpa, got 'paged'"):
        Runner(demo.model, demo.pool(), attention="paged")


def test_a_forced_triton_where_it_cannot_run_fails_in_one_line(demo, monkeypatch):
    reason = "the triton attention runs on CUDA, or on CPU under TRITON_INTERPRET=1"
    monkeypatch.setattr(llava.exec.triton_decode, "unavailable", lambda device: reason)
    with pytest.raises(SettingsError) as failure:
        Runner(demo.model, demo.pool(), attention="triton")
    assert str(failure.value) == f"bad setting attention: triton: {reason}"


@pytest.mark.thorough  # tens of seconds on a CPU: a flex compile, triton's interpreter
def test_auto_on_a_paged_path_keeps_the_faster_of_flex_and_triton(demo):
    """What warm-up does under auto on CUDA, the real timing: each path is called on the pool
    (the choice alone, with the times stood in for: the test below)."""
    runner = Runner(demo.model, demo.pool())
    runner.attention = "flex"  # what auto starts from on CUDA
    measured = runner.settle_attention(rows=2, tokens=40)
    assert set(measured) == {"flex", "triton"} and runner.attention in measured
    assert runner.attention == min(measured, key=measured.get)


def test_auto_keeps_the_paged_path_its_times_say_is_faster_and_a_forced_one_stays(
    demo, monkeypatch
):
    """What warm-up does under auto on CUDA, with the paths' times stood in for."""
    runner = Runner(demo.model, demo.pool())
    times = {"flex": 3.0, "triton": 1.0}
    monkeypatch.setattr(Runner, "_time_paged", lambda self, kind, rows, tokens: times[kind])
    runner.attention = "flex"
    assert runner.settle_attention() == times and runner.attention == "triton"
    forced = Runner(demo.model, demo.pool(), attention="flex")
    assert forced.settle_attention() is None and forced.attention == "flex"


def test_a_failing_flex_step_changes_nothing_and_auto_runs_it_again_on_sdpa(demo, monkeypatch):
    """Forced flex: the error comes out and no kv.length moved. Auto (resolved to flex, as on
    CUDA): the same step runs again on sdpa and gives sdpa's logits."""
    chunks = demo.chunks(held_out_samples(1, seed=33_500)[0].image, [QUESTIONS[0]])

    def broken(*args):
        raise RuntimeError("no kernel for this shape\n<log>")

    logits = {}
    for attention in ("flex", "auto", "sdpa"):
        runner = Runner(demo.model, demo.pool(), attention=attention)
        runner.attention = "flex" if attention == "auto" else runner.attention
        kv = runner.pool.new_kv()
        kv.reserve(sum(len(ids) for ids, _ in chunks) + 1)
        for ids, features in chunks:  # prefills alone: no flex call
            runner.step([StepInput(kv, ids, features)])
        length = kv.length
        with monkeypatch.context() as patch:
            patch.setattr(llava.exec.runner, "attend_paged", broken)
            if attention == "flex":
                with pytest.raises(PagedAttentionFailed, match="RuntimeError: no kernel for"):
                    runner.step([StepInput(kv, [7], None)])
                assert kv.length == length and runner.counters() == RunnerCounters()
                continue
            logits[attention] = runner.step([StepInput(kv, [7], None)])
        assert kv.length == length + 1 and runner.attention == "sdpa"
    torch.testing.assert_close(logits["auto"], logits["sdpa"], rtol=0, atol=0)


# -- refusals ------------------------------------------------------------------------------
def test_bad_steps_are_refused_before_anything_changes(demo):
    runner = Runner(demo.model, demo.pool())
    kv, other = runner.pool.new_kv(), runner.pool.new_kv()
    kv.reserve(4)
    other.reserve(4)
    image_id = demo.model.config.image_token_id
    features = torch.zeros(2, demo.model.config.text_config.hidden_size)
    cases = {
        "reserve first": [StepInput(kv, [5] * 17, None)],
        "twice": [StepInput(kv, [5], None), StepInput(kv, [6], None)],
        "no new ids": [StepInput(kv, [], None)],
        "1 image tokens in the new ids but 2": [StepInput(kv, [image_id, 5], features)],
        "2 image tokens in the new ids but 0": [StepInput(kv, [image_id, image_id], None)],
        "another pool": [StepInput(demo.pool().new_kv(), [5], None)],
    }
    for message, batch in cases.items():
        with pytest.raises(ValueError, match=message):
            runner.step([StepInput(other, [5], None), *batch])
    assert (kv.length, other.length) == (0, 0)


def meta_llava(**text) -> LlavaForConditionalGeneration:
    raw = json.loads((LLAVA_15 / "config.json").read_text())
    raw["text_config"].update(text)
    with torch.device("meta"):
        return LlavaForConditionalGeneration(LlavaConfig(**raw))


def test_llava_15_7b_is_supported():
    assert Runner.supports(meta_llava()) is None


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ({"model_type": "qwen2"}, "text model type 'qwen2'"),
        ({"model_type": "mistral", "sliding_window": 1024}, "sliding_window 1024"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
            "dynamic",
        ),
    ],
    ids=["qwen2", "mistral-sliding-window", "dynamic-rope"],
)
def test_unsupported_architectures_say_why(text, why):
    model = meta_llava(num_hidden_layers=1, **text)
    assert why in Runner.supports(model)
    with pytest.raises(ValueError, match=why):
        Runner(model, KVPool(model.config.text_config, 1 << 30, "meta", torch.float32))


def test_a_layer_without_the_llama_parts_is_refused():
    model = meta_llava(num_hidden_layers=1)
    delattr(model.model.language_model.layers[0], "mlp")
    assert "not LLaMA-like" in Runner.supports(model)
