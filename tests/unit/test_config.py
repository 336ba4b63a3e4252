"""Settings are checked when the config is built: a bad value names where it came from."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from llava.config import CHECKS, EngineConfig, SettingsError, load_config, setting_source

BASE = "/srv/mar"


def test_every_setting_has_a_check():
    assert {f.name for f in dataclasses.fields(EngineConfig)} == set(CHECKS)


def test_defaults_and_good_values_load():
    config = load_config(
        {"model_dir": "weights", "session_ttl_s": 1200, "intake": {"max_redirects": 1}},
        {"LLAVA_SESSION_TTL_S": "30.5", "LLAVA_DEVICE": "cuda:1", "LLAVA_INTAKE": '{"allow": []}'},
        BASE,
    )
    assert config.model_dir == f"{BASE}/weights"
    assert (config.session_ttl_s, config.device) == (30.5, "cuda:1")
    assert config.intake == {"max_redirects": 1, "allow": []}  # merged key by key


@pytest.mark.parametrize(
    ("environ", "named", "says"),
    [
        ({"LLAVA_SESSION_TTL_S": "abc"}, "LLAVA_SESSION_TTL_S", "'abc' is not a number"),
        ({"LLAVA_SESSION_TTL_S": "0"}, "LLAVA_SESSION_TTL_S", "> 0"),
        ({"LLAVA_SESSION_TTL_S": "true"}, "LLAVA_SESSION_TTL_S", "True is not"),
        ({"LLAVA_INTAKE": '{"allow": '}, "LLAVA_INTAKE", "not a JSON object"),
        ({"LLAVA_INTAKE": '{"allow": "10.0.0.0/8"}'}, "LLAVA_INTAKE", "list of strings"),
        ({"LLAVA_INTAKE": '{"max_redirect": 2}'}, "LLAVA_INTAKE", "unknown intake config keys"),
        ({"LLAVA_DEVICE": "gpu"}, "LLAVA_DEVICE", "comma-separated list of cpu, cuda and"),
        ({"LLAVA_DEVICE": "cpu,,cpu"}, "LLAVA_DEVICE", "comma-separated list of cpu, cuda and"),
        ({"LLAVA_DEVICE": "auto,cpu"}, "LLAVA_DEVICE", "comma-separated list of cpu, cuda and"),
        ({"LLAVA_DTYPE": "fp16"}, "LLAVA_DTYPE", "one of auto, float32"),
        ({"LLAVA_HOST_BUDGET_BYTES": "-1"}, "LLAVA_HOST_BUDGET_BYTES", "integer >= 0"),
        ({"LLAVA_DEVICE_HEADROOM_BYTES": "1.5"}, "LLAVA_DEVICE_HEADROOM_BYTES", "integer >= 0"),
        ({"LLAVA_CHECK_MEMORY_WHEN_IDLE": "1"}, "LLAVA_CHECK_MEMORY_WHEN_IDLE", "true or false"),
        ({"LLAVA_SESSION_BUDGET_FRACTION": "1.5"}, "LLAVA_SESSION_BUDGET_FRACTION", "(0, 1]"),
        ({"LLAVA_SESSION_BUDGET_BYTES": "-1"}, "LLAVA_SESSION_BUDGET_BYTES", "integer > 0"),
        ({"LLAVA_DEFAULT_MAX_NEW_TOKENS": "5000"}, "LLAVA_DEFAULT_MAX_NEW_TOKENS", "over max_new"),
        ({"LLAVA_TURN_DEADLINE_S": "60"}, "LLAVA_TURN_DEADLINE_S", "invocation limit"),
        ({"LLAVA_TURN_DEADLINE_S": "0"}, "LLAVA_TURN_DEADLINE_S", "> 0 and < 60"),
        ({"LLAVA_ATTENTION": "paged"}, "LLAVA_ATTENTION", "'paged' is not one of auto, flex"),
        ({"LLAVA_CUDA_GRAPHS": "yes"}, "LLAVA_CUDA_GRAPHS", "'yes' is not true or false"),
        ({"LLAVA_CUDA_GRAPHS": "0"}, "LLAVA_CUDA_GRAPHS", "0 is not true or false"),
        ({"LLAVA_MAX_BATCH": "0"}, "LLAVA_MAX_BATCH", "0 is not an integer > 0"),
        ({"LLAVA_MAX_BATCH": "8.5"}, "LLAVA_MAX_BATCH", "8.5 is not an integer > 0"),
        ({"LLAVA_PREFILL_CHUNK_TOKENS": "-1"}, "LLAVA_PREFILL_CHUNK_TOKENS", "integer > 0"),
        ({"LLAVA_MIXED_STEPS": "no"}, "LLAVA_MIXED_STEPS", "'no' is not true or false"),
    ],
)
def test_bad_environment_value_names_the_variable(environ, named, says):
    with pytest.raises(SettingsError) as failure:
        load_config({}, environ, BASE)
    message = str(failure.value)
    assert message.startswith(f"bad setting {named}: ") and says in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("archived", "named", "says"),
    [
        ({"session_ttl_s": "abc"}, "model-config.yaml handler.session_ttl_s", "not a number"),
        ({"max_question_chars": 0}, "model-config.yaml handler.max_question_chars", "> 0"),
        ({"sesion_ttl_s": 5}, "model-config.yaml handler.sesion_ttl_s", "unknown setting"),
        ({"model_dir": 7}, "model-config.yaml handler.model_dir", "a directory path"),
        ({"intake": ["x"]}, "model-config.yaml handler.intake", "not a JSON object"),
        ({"attention": "SDPA"}, "model-config.yaml handler.attention", "one of auto, flex, triton"),
        ({"cuda_graphs": "off"}, "model-config.yaml handler.cuda_graphs", "true or false"),
        ({"max_batch": True}, "model-config.yaml handler.max_batch", "True is not an integer"),
        ({"mixed_steps": 1}, "model-config.yaml handler.mixed_steps", "true or false"),
        (None, "model-config.yaml handler", "must be a mapping"),
    ],
)
def test_bad_archived_value_names_the_yaml_key(archived, named, says):
    with pytest.raises(SettingsError) as failure:
        load_config(archived, {}, BASE)
    assert str(failure.value).startswith(f"bad setting {named}: ")
    assert says in str(failure.value)


def test_attention_and_cuda_graphs_settings():
    """auto and graphs on by default; the environment's plain strings and JSON booleans load;
    a bad value built directly names its field."""
    default = load_config({}, {}, BASE)
    assert (default.attention, default.cuda_graphs) == ("auto", True)
    environ = {"LLAVA_ATTENTION": "sdpa", "LLAVA_CUDA_GRAPHS": "false"}
    config = load_config({"attention": "flex"}, environ, BASE)
    assert (config.attention, config.cuda_graphs) == ("sdpa", False)
    for field, value in (("attention", "paged"), ("attention", None), ("cuda_graphs", "true")):
        with pytest.raises(SettingsError) as failure:
            EngineConfig(model_dir="-", **{field: value})
        assert failure.value.setting == field
        assert str(failure.value).startswith(f"bad setting {field}: ")


def test_scheduler_settings():
    """32 sequences a step, 512 prefill ids a step, mixed steps by default; the archive and the
    environment set them like any setting; a bad value is one line naming its field."""
    default = load_config({}, {}, BASE)
    assert (default.max_batch, default.prefill_chunk_tokens, default.mixed_steps) == (32, 512, True)
    environ = {"LLAVA_MAX_BATCH": "8", "LLAVA_MIXED_STEPS": "false"}
    config = load_config({"max_batch": 1, "prefill_chunk_tokens": 256}, environ, BASE)
    assert (config.max_batch, config.prefill_chunk_tokens, config.mixed_steps) == (8, 256, False)
    for field, value in (("max_batch", 0), ("prefill_chunk_tokens", "512"), ("mixed_steps", None)):
        with pytest.raises(SettingsError) as failure:
            EngineConfig(model_dir="-", **{field: value})
        assert failure.value.setting == field
        message = str(failure.value)
        assert message.startswith(f"bad setting {field}: ") and "\n" not in message


def test_environment_wins_and_is_blamed_only_for_its_own_value():
    with pytest.raises(SettingsError, match="model-config.yaml handler.dtype"):
        load_config({"dtype": "fp8"}, {"LLAVA_SESSION_TTL_S": "60"}, BASE)
    config = load_config({"session_ttl_s": "abc"}, {"LLAVA_SESSION_TTL_S": "60"}, BASE)
    assert config.session_ttl_s == 60


def test_unknown_llava_variables_are_warned_about(caplog):
    with caplog.at_level(logging.WARNING, logger="llava.config"):
        load_config({}, {"LLAVA_SESION_TTL_S": "5", "LLAVA_DEVICE": "cpu", "HOME": "/"}, BASE)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "LLAVA_SESION_TTL_S" in warnings[0]


def test_the_seeds_ttl_in_minutes_sets_the_ttl_in_seconds():
    assert load_config({}, {"SES_TTL_MIN": "10"}, BASE).session_ttl_s == 600
    # ours wins over the archived value the same way; agreeing with LLAVA_SESSION_TTL_S is fine
    both = {"SES_TTL_MIN": "2", "LLAVA_SESSION_TTL_S": "120"}
    assert load_config({"session_ttl_s": 5}, both, BASE).session_ttl_s == 120


@pytest.mark.parametrize(
    ("environ", "says"),
    [
        (
            {"SES_TTL_MIN": "10", "LLAVA_SESSION_TTL_S": "300"},
            "bad setting SES_TTL_MIN: SES_TTL_MIN=10 (minutes, 600 s) conflicts with "
            "LLAVA_SESSION_TTL_S=300; set only one",
        ),
        ({"SES_TTL_MIN": "ten"}, "bad setting SES_TTL_MIN: 'ten' is not a number of minutes"),
        ({"SES_TTL_MIN": "-1"}, "bad setting SES_TTL_MIN: -60.0 is not a number of seconds > 0"),
    ],
)
def test_a_bad_or_conflicting_seed_name_fails_in_one_line(environ, says):
    with pytest.raises(SettingsError) as failure:
        load_config({}, environ, BASE)
    assert str(failure.value) == says


def test_a_host_budget_this_machine_cannot_hold_fails_the_start_in_one_line():
    """Checked once the model is in (llava.kv.budget.memory_budget), named like any setting."""
    import torch

    from llava.kv.budget import memory_budget

    environ = {"LLAVA_HOST_BUDGET_BYTES": str(1 << 60)}
    config = load_config({"model_dir": "-"}, environ, BASE)
    with pytest.raises(SettingsError) as err:
        memory_budget(config, torch.device("cpu"))
    message = str(err.value.from_source(setting_source(err.value.setting, environ)))
    assert message.startswith("bad setting LLAVA_HOST_BUDGET_BYTES: ") and "\n" not in message
    assert "free on this host" in message
    budget = memory_budget(
        load_config({"model_dir": "-", "host_budget_bytes": 0}, {}, BASE), torch.device("cpu")
    )
    assert (budget.host_bytes, budget.headroom_bytes) == (0, 0)
