"""Generation parameters from the wire: aliases, unknown names, bounds."""

from __future__ import annotations

import pytest

from llava.errors import InvalidRequest
from llava.sampling.params import GenerationParams

LIMITS = {"default_max_new_tokens": 128, "max_new_tokens_limit": 1024}


@pytest.mark.parametrize("name", ["max_new_tokens", "max_tokens", "max_new_token"])
def test_every_spelling_of_max_new_tokens_is_honoured(name):
    assert GenerationParams.from_mapping({name: 64}, **LIMITS).max_new_tokens == 64


def test_two_spellings_of_one_parameter_are_refused():
    with pytest.raises(InvalidRequest, match="max_new_token"):
        GenerationParams.from_mapping({"max_new_tokens": 8, "max_new_token": 64}, **LIMITS)


def test_an_unknown_parameter_is_refused_with_the_known_names():
    with pytest.raises(InvalidRequest) as err:
        GenerationParams.from_mapping({"max_length": 64}, **LIMITS)
    assert "max_length" in err.value.message
    assert "max_new_tokens" in err.value.message and "temperature" in err.value.message


@pytest.mark.parametrize(
    ("sent", "greedy"),
    [
        ({}, True),
        ({"seed": 3}, True),
        ({"temperature": 0.7}, False),
        ({"top_p": 0.9}, False),
        ({"top_k": 40}, False),
        ({"temperature": 0}, True),
        ({"temperature": 0.7, "do_sample": False}, True),
        ({"do_sample": True}, False),
    ],
)
def test_a_sampling_parameter_asks_for_sampling_unless_do_sample_is_false(sent, greedy):
    assert GenerationParams.from_mapping(sent, **LIMITS).greedy is greedy
