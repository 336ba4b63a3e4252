"""The seeds' client runs unmodified against the local endpoint (issue 15 item 3).

It needs the container to adopt a client-chosen id (``extSessionID`` on open, issue 12).
"""

from __future__ import annotations

import pytest

from tests.endpoint_helpers import DUMMY_CREDENTIALS, ENDPOINT, ShapeImages, start_endpoint
from tests.seed_client import LlavaChatSession

pytestmark = pytest.mark.torchserve


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    endpoint = start_endpoint(tmp_path_factory.mktemp("seed-endpoint"), instances=1)
    yield endpoint
    endpoint.stop()


def test_the_seeds_client_chats_unmodified(endpoint, demo_model, monkeypatch):
    # the seeds' client takes its credentials from the environment, as boto3 does on AWS
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", DUMMY_CREDENTIALS["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", DUMMY_CREDENTIALS["aws_secret_access_key"])
    images = ShapeImages(demo_model, 1)
    truth = images.samples[0]
    try:
        chat = LlavaChatSession(ENDPOINT, endpoint_url=endpoint.url)
        announced = chat.start(images.url(0))
        assert announced.split(";")[0] == chat.session_id  # its own id, adopted
        assert chat.ask("What color is the shape?") == truth.color
        assert chat.ask("And its shape?", max_new_token=8) == truth.shape
        assert chat.end() == chat.session_id
    finally:
        images.close()
