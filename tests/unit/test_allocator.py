"""The CUDA allocator's settings asked for before CUDA starts (llava.kv.allocator)."""

from __future__ import annotations

import pytest

from llava.kv.allocator import use_expandable_segments


def test_expandable_segments_are_asked_for_when_nobody_configured_the_allocator():
    environ = {"PYTORCH_ALLOC_CONF": ""}
    use_expandable_segments(environ)
    assert environ == {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}


@pytest.mark.parametrize(
    "operators",
    [
        {"PYTORCH_ALLOC_CONF": "expandable_segments:False"},
        {"PYTORCH_ALLOC_CONF": "max_split_size_mb:128"},
        {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"},
    ],
)
def test_an_operators_own_allocator_setting_stands_as_it_is(operators):
    environ = dict(operators)
    use_expandable_segments(environ)
    assert environ == operators
