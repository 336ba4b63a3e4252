"""AWS on loopback for tests: moto's server (a real HTTP server speaking AWS's APIs on
127.0.0.1, in place of the AWS that does not exist here) and the environment that sends boto3
to it with test credentials, never to a real account."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from moto.server import ThreadedMotoServer

from tests.intake_servers import forbid_non_loopback


@contextmanager
def moto_endpoint() -> Iterator[str]:
    """A moto server on 127.0.0.1 for the duration: its URL."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def local_aws_env(monkeypatch, **variables: str) -> None:
    """boto3 with test credentials and no profile, config file or instance metadata, only
    loopback reachable; ``variables``: more of the environment (AWS_ENDPOINT_URL_S3=...)."""
    forbid_non_loopback(monkeypatch)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
