"""python -m capacity: its per-session bytes are what the engine really counts, its 7B
figures follow from the config alone, and it says which checkpoints the engine refuses."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from capacity.__main__ import main as capacity_cli
from capacity.instances import INSTANCES
from capacity.sizing import (
    Workload,
    fit,
    load_checkpoint,
    parse_size,
    session_bytes,
)
from demo_model.synthetic import held_out_samples
from llava.config import EngineConfig
from llava.engine import Engine
from llava.kv.memory import MemoryBudget, Tier
from tests.conftest import DEMO_MODEL_DIR, REPO

LLAVA_15 = REPO / "tests" / "fixtures" / "llava-1.5-7b-hf"


def test_an_opened_session_holds_exactly_the_bytes_capacity_predicts(demo_model):
    engine = Engine(demo_model, EngineConfig("-"), MemoryBudget(8 << 20))
    engine.open(held_out_samples(1, seed=71_000)[0].image)
    held = engine.stats().bytes_by_tier
    predicted = session_bytes(load_checkpoint(str(DEMO_MODEL_DIR), torch.float32), Workload(0, 0))
    assert (held[Tier.KV], held[Tier.FEATURES]) == (predicted.kv, predicted.features)
    assert predicted.kv > 0 and predicted.features > 0


def test_a_sessions_persistent_entry_takes_about_what_capacity_predicts(demo_model, tmp_path):
    """Its features exactly; its history as text at 4 characters a token, 5-digit ids."""
    config = EngineConfig("-", persist_dir=str(tmp_path))
    engine = Engine(demo_model, config, MemoryBudget(8 << 20))
    session_id = engine.open(held_out_samples(1, seed=71_001)[0].image).session_id
    engine.ask(session_id, "What color is the shape?", {"max_new_tokens": 60})
    features = (tmp_path / f"{session_id}.features").stat().st_size
    written = engine.journal.total_bytes
    predicted = session_bytes(load_checkpoint(str(DEMO_MODEL_DIR), torch.float32), Workload(1, 60))
    assert features < predicted.persisted
    assert abs(predicted.persisted - written) <= 0.1 * written, (predicted.persisted, written)


def test_llava_15_7b_from_its_config_alone():
    checkpoint = load_checkpoint(str(LLAVA_15), torch.float16)
    assert checkpoint.refusal is None
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
    checkpoint = load_checkpoint(str(LLAVA_15), torch.float16)
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


def test_the_cli_prints_the_table_for_one_instance(capsys):
    assert (
        capacity_cli(["--model-dir", str(LLAVA_15), "--instance", "ml.g6e.xlarge", "--turns", "4"])
        == 0
    )
    printed = capsys.readouterr().out
    assert "the engine runs it" in printed and "512 KiB per token" in printed
    rows = [line for line in printed.splitlines() if line.startswith("ml.")]
    assert [row.split()[0] for row in rows] == ["ml.g6e.xlarge"]
    assert "NVIDIA L40S datasheet" in printed  # every figure says where it came from


def test_a_checkpoint_the_runner_cannot_run_is_reported_with_the_engines_message(tmp_path, capsys):
    model_dir = tmp_path / "sliding"
    shutil.copytree(LLAVA_15, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["text_config"].update(model_type="mistral", sliding_window=4096, num_hidden_layers=1)
    (model_dir / "config.json").write_text(json.dumps(config))
    assert capacity_cli(["--model-dir", str(model_dir), "--gpu-memory", "24GiB"]) == 1
    printed = capsys.readouterr().out
    assert (
        "REFUSED at start: ValueError: the step runner cannot run this model: "
        "text model type 'mistral'" in printed
    )


@pytest.mark.parametrize(
    ("text", "size"), [("24GiB", 24 * 1024**3), ("48 GB", 48 * 10**9), ("1024", 1024)]
)
def test_sizes_parse_with_their_units(text, size):
    assert parse_size(text) == size
