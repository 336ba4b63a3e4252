"""python -m capacity: its per-session bytes are what the engine really counts, its 7B
figures follow from the config alone (LLaVA-NeXT's at its largest image, Mistral's GQA KV), and
a checkpoint the engine refuses is refused in one line before anything is sized."""

from __future__ import annotations

import subprocess
import sys
import time
from functools import cache

import pytest
import torch

from capacity.__main__ import main as capacity_cli
from capacity.instances import INSTANCES
from capacity.sizing import (
    Workload,
    fit,
    image_bytes,
    load_checkpoint,
    parse_size,
    session_bytes,
)
from demo_model.synthetic import held_out_samples
from llava.config import EngineConfig
from llava.engine import Engine
from llava.kv.budget import MemoryBudget, session_kv_bytes
from llava.kv.holding import Tier
from llava.model.checkpoint import inspect_checkpoint
from llava.model.vision import image_tokens
from tests.checkpoints import LLAVA_15, LLAVA_NEXT, UNSUPPORTED, unsupported_checkpoint
from tests.conftest import DEMO_MODEL_DIR, REPO

NEXT_ROWS = ("ml.g5.2xlarge", "ml.g5.12xlarge", "ml.p4d.24xlarge")
KiB, MiB = 2**10, 2**20


@cache
def loaded_checkpoint(model_dir, dtype: torch.dtype):
    """load_checkpoint, once for each model and dtype: the tests only read what it returns."""
    return load_checkpoint(str(model_dir), dtype)


def test_an_opened_session_holds_exactly_the_bytes_capacity_predicts(demo_model):
    engine = Engine(demo_model, EngineConfig("-"), MemoryBudget(8 << 20))
    engine.open(held_out_samples(1, seed=71_000)[0].image)
    held = engine.stats().bytes_by_tier
    predicted = session_bytes(loaded_checkpoint(DEMO_MODEL_DIR, torch.float32), Workload(0, 0))
    assert (held[Tier.KV], held[Tier.FEATURES]) == (predicted.kv, predicted.features)
    assert predicted.kv > 0 and predicted.features > 0


def test_a_sessions_persistent_entry_takes_about_what_capacity_predicts(demo_model, tmp_path):
    """Its features exactly; its history as text at 4 characters a token, 5-digit ids."""
    config = EngineConfig("-", persist_dir=str(tmp_path))
    engine = Engine(demo_model, config, MemoryBudget(8 << 20))
    session_id = engine.open(held_out_samples(1, seed=71_001)[0].image).session_id
    engine.ask(session_id, "What color is the shape?", {"max_new_tokens": 60})
    features = (tmp_path / f"{session_id}.features").stat().st_size
    written = engine.persistent.journal.total_bytes
    predicted = session_bytes(loaded_checkpoint(DEMO_MODEL_DIR, torch.float32), Workload(1, 60))
    assert features < predicted.persisted
    assert abs(predicted.persisted - written) <= 0.1 * written, (predicted.persisted, written)


def test_llava_15_7b_from_its_config_alone():
    checkpoint = loaded_checkpoint(LLAVA_15, torch.float16)
    assert (checkpoint.family, checkpoint.image_tokens) == ("llava", 576)
    assert checkpoint.kv_bytes_per_token == 32 * 2 * 32 * 128 * 2  # layers, K+V, heads, dim, fp16
    assert 7.0e9 < checkpoint.weight_bytes / 2 < 7.1e9  # 7.06 B parameters
    # 576 x 4096 fp16 features (4.5 MiB) take one whole pool block of 16 tokens x 512 KiB
    assert checkpoint.feature_bytes == 16 * checkpoint.kv_bytes_per_token > 576 * 4096 * 2
    per = session_bytes(checkpoint, Workload(turns=10, tokens_per_turn=60))
    assert per.tokens == checkpoint.opening_tokens + 600
    assert per.kv == -(-per.tokens // 16) * 16 * checkpoint.kv_bytes_per_token
    g5 = INSTANCES["ml.g5.2xlarge"]
    room = fit(checkpoint, per, g5.gpu_memory_bytes, g5.host_memory_bytes // 2, EngineConfig("-"))
    # the engine's default: 80 % of what the weights leave of the A10G's 24 GiB
    assert abs(room.device_budget - 0.8 * (24 * 2**30 - checkpoint.weight_bytes)) <= 1
    # 600 MiB a hot session (docs/deploy.md §Sizing: sessions per instance)
    assert room.device_kv == 14
    assert room.features_only > 50 * room.device_kv  # demotion is what lets many sessions stay


def test_a_multi_gpu_instance_holds_one_shards_sessions_per_gpu():
    """ml.g5.12xlarge: 4 x A10G 24 GiB, one engine shard each; the host tier (a quarter of
    192 GiB) is split four ways, as ShardedEngine.from_config splits it."""
    checkpoint = loaded_checkpoint(LLAVA_15, torch.float16)
    per = session_bytes(checkpoint, Workload(turns=10, tokens_per_turn=60))
    g5 = INSTANCES["ml.g5.12xlarge"]
    host = g5.host_memory_bytes // 4
    config = EngineConfig("-")
    instance = fit(checkpoint, per, g5.gpu_memory_bytes, host, config, shards=g5.gpus)
    one_gpu = fit(checkpoint, per, g5.gpu_memory_bytes, host // 4, config)
    assert g5.gpus == 4 and instance.device_budget == one_gpu.device_budget
    assert instance.device_kv == 4 * one_gpu.device_kv == 56  # 14 hot sessions per A10G
    assert instance.features_only == 4 * one_gpu.features_only
    # 12 GiB of host tier per shard holds 20 sessions' 592 MiB of KV
    assert instance.host_kv == 4 * one_gpu.host_kv == 4 * ((48 * 2**30 // 4) // per.kv) == 80


def test_llava_next_mistral_7b_sizes_its_largest_image_and_gqa_kv():
    """llava-v1.6-mistral-7b-hf: 2,928 image tokens (a 672 x 672 image: 4 tiles + the
    global view, nothing unpadded), and Mistral's 8 KV heads of 128: a quarter of llava-1.5's
    KV per token, so a session of three times the tokens still holds fewer bytes."""
    checkpoint = loaded_checkpoint(LLAVA_NEXT, torch.bfloat16)
    assert (checkpoint.family, checkpoint.image_tokens) == ("llava_next", 2928)
    processor = inspect_checkpoint(LLAVA_NEXT).processor
    assert image_tokens(processor, 640, 480) < checkpoint.image_tokens  # fewer for most images
    assert checkpoint.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2  # layers, K+V, KV heads, dim
    assert 7.5e9 < checkpoint.weight_bytes / 2 < 7.6e9  # 7.57 B parameters
    assert checkpoint.image_tokens < checkpoint.opening_tokens < checkpoint.image_tokens + 20
    # 2,928 x 4096 bf16 features (22.9 MiB) in 12 whole pool blocks of 16 tokens x 128 KiB
    assert checkpoint.feature_shape == (2928, 4096)
    assert checkpoint.feature_bytes == 12 * 16 * checkpoint.kv_bytes_per_token
    per = session_bytes(checkpoint, Workload(turns=10, tokens_per_turn=60))
    assert per.kv == -(-per.tokens // 16) * 16 * 128 * 2**10
    llava_15 = loaded_checkpoint(LLAVA_15, torch.bfloat16)
    assert 4 * checkpoint.kv_bytes_per_token == llava_15.kv_bytes_per_token
    same = session_kv_bytes(per.tokens, llava_15.kv_bytes_per_token, 16)
    assert 4 * per.kv == same
    older = session_bytes(llava_15, Workload(turns=10, tokens_per_turn=60))
    assert per.tokens > 2.5 * older.tokens and per.kv + per.features < older.kv + older.features
    g5 = INSTANCES["ml.g5.2xlarge"]
    room = fit(checkpoint, per, g5.gpu_memory_bytes, g5.host_memory_bytes // 4, EngineConfig("-"))
    assert room.device_kv == 17 == room.device_budget // (per.kv + per.features)
    assert room.host_kv == 18 and room.features_only == room.device_budget // (24 * 2**20)


def test_the_cli_prints_the_table_for_one_instance(capsys):
    assert (
        capacity_cli(["--model-dir", str(LLAVA_15), "--instance", "ml.g6e.xlarge", "--turns", "4"])
        == 0
    )
    printed = capsys.readouterr().out
    assert "the engine runs it" in printed and "512 KiB per token" in printed
    assert "image tokens per session: 576 (the same for every image)" in printed
    rows = [line for line in printed.splitlines() if line.startswith("ml.")]
    assert [row.split()[0] for row in rows] == ["ml.g6e.xlarge"]
    assert "NVIDIA L40S datasheet" in printed  # every figure says where it came from


def test_an_extra_image_holds_exactly_the_bytes_capacity_predicts(demo_model):
    """Two engines, one session each on the same image, the same question with an answer of
    the same length; one turn also sends a second image: that engine holds one more image's
    features and its tokens' KV, to the byte (64 image tokens: whole blocks either way)."""
    first, second = (sample.image for sample in held_out_samples(2, seed=71_002))
    held = []
    for image in (None, second):
        engine = Engine(demo_model, EngineConfig("-"), MemoryBudget(8 << 20))
        session_id = engine.open(first).session_id
        same_length = {"max_new_tokens": 4, "min_new_tokens": 4}
        answer = engine.ask(session_id, "And this one?", same_length, image=image)
        assert answer.images == (2 if image else 1)
        held.append(engine.stats().bytes_by_tier)
    without, with_image = held
    extra = image_bytes(loaded_checkpoint(DEMO_MODEL_DIR, torch.float32))
    assert extra.tokens == 64 and extra.features > 0 and extra.kv > 0
    assert with_image[Tier.FEATURES] - without[Tier.FEATURES] == extra.features
    assert with_image[Tier.KV] - without[Tier.KV] == extra.kv


@pytest.mark.parametrize(
    ("model_dir", "tokens", "kv_per_token", "pool_blocks"),
    [(LLAVA_15, 576, 32 * 2 * 4096 * 2, 1), (LLAVA_NEXT, 2928, 32 * 2 * 1024 * 2, 12)],
    ids=["llava-1.5-7b", "llava-next-mistral-7b"],
)
def test_an_extra_image_costs_its_features_and_its_tokens_kv(
    model_dir, tokens, kv_per_token, pool_blocks
):
    """bf16: llava-1.5's 576 tokens (every image), NeXT's largest image's 2,928; features of
    tokens x 4096 x 2 B in whole pool blocks of 16 tokens' KV, and KV of every image token in
    32 layers (K and V: llava-1.5's 32 heads of 128, Mistral's 8 KV heads of 128)."""
    checkpoint = loaded_checkpoint(model_dir, torch.bfloat16)
    extra = image_bytes(checkpoint)
    assert (extra.tokens, checkpoint.kv_bytes_per_token) == (tokens, kv_per_token)
    assert extra.raw_features == tokens * 4096 * 2
    assert extra.features == pool_blocks * 16 * kv_per_token >= extra.raw_features
    assert extra.kv == tokens * kv_per_token
    assert extra.total == extra.features + extra.kv
    if model_dir == LLAVA_15:  # 4.5 MiB of features in one 8 MiB block, and 288 MiB of KV
        assert (extra.raw_features, extra.features, extra.kv) == (4.5 * MiB, 8 * MiB, 288 * MiB)
    else:  # 22.9 MiB of features in 24 MiB, and 366 MiB of KV
        assert (extra.features, extra.kv) == (24 * MiB, 366 * MiB)
        assert extra.raw_features == 2928 * 8 * KiB


def test_the_cli_prints_what_each_extra_image_costs(capsys):
    flags = ["--instance", "ml.g5.2xlarge", "--dtype", "bfloat16"]
    assert capacity_cli(["--model-dir", str(LLAVA_15), *flags]) == 0
    printed = capsys.readouterr().out
    assert (
        "each extra image (a turn's image): 576 tokens (the same for every image): features"
        " 4.5 MiB (8.0 MiB in pool blocks) + KV 288.0 MiB = 296.0 MiB on the GPU"
    ) in printed
    assert (
        "at most 4 images a session (max_images_per_session, the open's included):"
        " 3 more add 888.0 MiB"
    ) in printed


# make test-fast runs the command for llava-1.5 (above) and checks NeXT's figures in-process
# (test_llava_next_mistral_7b_sizes_its_largest_image_and_gqa_kv)
@pytest.mark.thorough
def test_the_cli_sizes_llava_next_on_the_three_instances(capsys):
    flags = [arg for name in NEXT_ROWS for arg in ("--instance", name)]
    assert capacity_cli(["--model-dir", str(LLAVA_NEXT), *flags]) == 0
    printed = capsys.readouterr().out
    assert "checkpoint llava-v1.6-mistral-7b-hf (llava_next): the engine runs it" in printed
    assert (
        "image tokens per session: 2,928 (the largest image; NeXT counts depend on the image size)"
        in printed
    )
    assert "128 KiB per token" in printed
    rows = {line.split()[0]: line.split() for line in printed.splitlines() if line[:3] == "ml."}
    assert tuple(rows) == NEXT_ROWS
    # instance, GPUs, GPU mem (2), host RAM (2), budget (2), device KV, host KV, features
    hot = {name: int(row[8].replace(",", "")) for name, row in rows.items()}
    assert hot == {"ml.g5.2xlarge": 17, "ml.g5.12xlarge": 4 * 17, "ml.p4d.24xlarge": 8 * 40}


@pytest.mark.thorough  # a child process each (the refusals in-process: test_checkpoint_inspect)
@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_a_checkpoint_the_engine_refuses_is_refused_in_one_line(tmp_path, case):
    """The engine start's own refusal (llava.model.checkpoint), on stderr, exit 1, no table and
    no traceback, in seconds: nothing but the small files is read."""
    model_dir, named = unsupported_checkpoint(tmp_path / "checkpoint", case)
    command = [sys.executable, "-m", "capacity", "--model-dir", str(model_dir)]
    began = time.monotonic()
    done = subprocess.run(
        [*command, "--instance", "ml.g5.2xlarge"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - began
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    [line] = done.stderr.splitlines()
    assert line.startswith(f"bad setting model_dir: {model_dir} cannot be served: "), line
    assert named in line
    assert took < 30, took


@pytest.mark.parametrize(
    ("text", "size"), [("24GiB", 24 * 1024**3), ("48 GB", 48 * 10**9), ("1024", 1024)]
)
def test_sizes_parse_with_their_units(text, size):
    assert parse_size(text) == size
