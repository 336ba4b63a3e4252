"""The image threads (llava.intake.loader): a request waits for one and its image together at
most ``intake.deadline_s``, and a slow image holds only its own thread."""

from __future__ import annotations

import base64
import threading

import pytest
from PIL import Image

from llava.errors import ImageFetchFailed
from llava.intake import IntakePolicy
from llava.intake import loader as loader_module
from llava.intake.loader import ImageLoader
from tests.intake_servers import image_bytes


def b64_source(color) -> dict[str, str]:
    return {"b64": base64.b64encode(image_bytes(Image.new("RGB", (8, 6), color))).decode()}


def test_a_load_that_waits_past_its_deadline_for_the_one_thread_fails_and_the_pool_recovers(
    monkeypatch,
):
    """One image thread, held by a slow image (a large decode, which no deadline stops): the
    next load is refused at its deadline without ever running; once the slow one ends, loads
    are served again."""
    slow, waiting, after = b64_source((255, 0, 0)), b64_source((0, 255, 0)), b64_source((0, 0, 9))
    holding, release = threading.Event(), threading.Event()
    ran = []
    real_load_image = loader_module.load_image

    def load_image(source, policy, fit):
        ran.append(source)
        if source is slow:
            holding.set()
            assert release.wait(30)
        return real_load_image(source, policy, fit)

    monkeypatch.setattr(loader_module, "load_image", load_image)
    images = ImageLoader(IntakePolicy(deadline_s=0.5), workers=1)
    slow_failure = []

    def load_slow():
        with pytest.raises(ImageFetchFailed) as failed:
            images.load(slow)
        slow_failure.append(str(failed.value))

    first = threading.Thread(target=load_slow)
    first.start()
    try:
        assert holding.wait(10)
        with pytest.raises(ImageFetchFailed, match=r"no image thread came free within 0\.5 s"):
            images.load(waiting)
        first.join(10)
        assert slow_failure and "took longer than 0.5 s" in slow_failure[0]
    finally:
        release.set()
        first.join(10)

    assert images.load(after).getpixel((0, 0)) == (0, 0, 9)
    assert waiting not in ran  # refused while queued: it never ran
