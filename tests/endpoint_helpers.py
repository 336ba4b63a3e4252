"""A local endpoint over real TorchServe instances, and images to ask about (its boto3 clients:
LocalEndpoint.runtime).

Nothing is mocked: boto3 signs and sends real HTTP to the local endpoint, which forwards to real
TorchServe processes serving model-store/llava.mar. The credentials are dummies: the local
endpoint does not check signatures (only AWS can verify IAM).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from local_endpoint.launcher import LocalEndpoint
from serving.mar import build_mar
from serving.torchserve import free_ports
from tests.conftest import DEMO_MODEL_DIR, REPO, recognized_samples
from tests.intake_servers import LoopbackServer, image_bytes, respond

ENDPOINT = "stateful-llava"
MAR = REPO / "model-store" / "llava.mar"
DUMMY_CREDENTIALS = {
    "region_name": "us-east-1",
    "aws_access_key_id": "local",
    "aws_secret_access_key": "local",
}


def start_endpoint(run_dir: Path, instances: int, part_bytes: int = 0) -> LocalEndpoint:
    if not MAR.exists():  # `make test` builds it with `make mar`; a bare pytest run may not
        build_mar(DEMO_MODEL_DIR)
    endpoint = LocalEndpoint(
        run_dir,
        instances,
        port=free_ports(1)[0],
        part_bytes=part_bytes,
        env={"LLAVA_INTAKE": json.dumps({"allow": ["127.0.0.1"]})},  # images on loopback
    )
    endpoint.start(timeout=180)
    return endpoint


def endpoint_fixture(label: str, instances: int, **options):
    """A test module's endpoint: started for its first test, stopped after its last."""

    @pytest.fixture(scope="module")
    def endpoint(tmp_path_factory):
        started = start_endpoint(tmp_path_factory.mktemp(label), instances, **options)
        yield started
        started.stop()

    return endpoint


def images_fixture(count: int):
    """A test module's ``ShapeImages`` on a loopback server, closed after its last test."""

    @pytest.fixture(scope="module")
    def images(demo_model):
        served = ShapeImages(demo_model, count)
        yield served
        served.close()

    return images


class ShapeImages:
    """Images the demo model recognizes, differing pairwise in colour and shape, on loopback."""

    def __init__(self, demo_model, count: int):
        self.samples = []
        for candidate in recognized_samples(demo_model, 12, seed=90_000):
            if all(candidate.color != s.color and candidate.shape != s.shape for s in self.samples):
                self.samples.append(candidate)
            if len(self.samples) == count:
                break
        self.http = LoopbackServer()
        for i, sample in enumerate(self.samples):
            self.http.routes[f"/{i}.png"] = respond(
                image_bytes(sample.image), headers={"Content-Type": "image/png"}
            )

    def url(self, i: int) -> str:
        return self.http.url(f"/{i}.png")

    def close(self) -> None:
        self.http.close()


def start_endpoint_on_disk(
    run_dir: Path, instances: int, durable_store: str | None = None
) -> LocalEndpoint:
    """An endpoint whose instances keep their persistent tier under ``run_dir/persist`` (the
    tests' default turns it off: tests/conftest.py; a durable store needs it), and share
    ``durable_store`` (``s3-local``: moto's S3 on loopback, started and stopped with it)."""
    if not MAR.exists():
        build_mar(DEMO_MODEL_DIR)
    endpoint = LocalEndpoint(
        run_dir,
        instances,
        port=free_ports(1)[0],
        env={
            "LLAVA_INTAKE": json.dumps({"allow": ["127.0.0.1"]}),
            "LLAVA_PERSIST_DIR": str(run_dir / "persist"),
        },
        durable_store=durable_store,
    )
    endpoint.start(timeout=180)
    return endpoint
