"""The seeds' client runs unmodified against the local endpoint even with
no ``endpoint_url`` at all (boto3's ``AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME``), and our client
opens sessions under ids its caller chooses.

Both need the container to adopt a client-chosen id (``extSessionID`` on open).
"""

from __future__ import annotations

import uuid

import pytest

from llava_client import LlavaClient, LlavaError
from tests.endpoint_helpers import DUMMY_CREDENTIALS, ENDPOINT, endpoint_fixture, images_fixture
from tests.seed_client import LlavaChatSession

pytestmark = pytest.mark.torchserve


endpoint = endpoint_fixture("seed-endpoint", instances=1)


images = images_fixture(1)


@pytest.mark.parametrize("pointed_by", ["endpoint_url", "AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME"])
def test_the_seeds_client_chats_unmodified(endpoint, images, monkeypatch, pointed_by):
    # the seeds' client takes its credentials from the environment, as boto3 does on AWS
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", DUMMY_CREDENTIALS["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", DUMMY_CREDENTIALS["aws_secret_access_key"])
    url = None
    if pointed_by == "endpoint_url":
        url = endpoint.url
    else:  # boto3 reads it for every sagemaker-runtime client: code that names no endpoint
        monkeypatch.setenv("AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME", endpoint.url)
    truth = images.samples[0]
    chat = LlavaChatSession(ENDPOINT, endpoint_url=url)
    assert chat.runtime.meta.endpoint_url == endpoint.url
    announced = chat.start(images.url(0))
    assert announced.split(";")[0] == chat.session_id  # its own id, adopted
    assert chat.ask("What color is the shape?") == truth.color
    assert chat.ask("And its shape?", max_new_token=8) == truth.shape
    assert chat.end() == chat.session_id


def test_our_client_opens_under_the_id_its_caller_chooses(endpoint, images):
    client = LlavaClient(ENDPOINT, runtime=endpoint.runtime())
    chosen = f"ticket-{uuid.uuid4().hex}"  # 128 bits or more: kept as it is
    with client.open(images.url(0), session_id=chosen) as chat:
        assert chat.id == chosen
        assert chat.ask("What color is the shape?").text == images.samples[0].color
        with pytest.raises(LlavaError) as taken:  # a live id is never shared
            client.open(images.url(0), session_id=chosen)
        assert taken.value.code == "SESSION_ID_IN_USE" and taken.value.status == 400
