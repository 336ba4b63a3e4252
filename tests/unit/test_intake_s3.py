"""Image intake from S3 through boto3, against moto's S3 server on 127.0.0.1.

No real AWS exists in tests: moto's server mode is a real HTTP server on loopback that speaks
the S3 protocol, so the whole boto3 path (signing, streaming, error parsing) runs for real.
Access denied is moto's IAM simulation (``enable_iam_authentication``) with a user that has no
policies: S3 answers AccessDenied as it would to a role without s3:GetObject.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap

import boto3
import pytest
from moto.core.authorization import enable_iam_authentication
from PIL import Image

from handlers.errors import error_response
from llava.errors import ImageFetchFailed, ImageSourceNotAllowed, ImageTooLarge, NotAnImage
from llava.intake import IntakePolicy, load_image
from tests.aws_local import local_aws_env
from tests.intake_servers import image_bytes

BUCKET = "intake-test-images"
PROBED = "intake-probed"  # listed; whether it exists, and what it holds, is up to each test
PNG = image_bytes(Image.new("RGB", (5, 4), (0, 128, 255)))


@pytest.fixture
def s3(moto_url, monkeypatch):
    """An S3 client on moto with test credentials; the bucket holds a PNG and a text file."""
    local_aws_env(monkeypatch)
    client = boto3.client("s3", endpoint_url=moto_url, region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    client.put_object(Bucket=BUCKET, Key="cat.png", Body=PNG)
    client.put_object(Bucket=BUCKET, Key="notes.png", Body=b"plain text")
    return client


@pytest.fixture
def policy(moto_url):
    return IntakePolicy(
        s3_endpoint_url=moto_url, s3_region="us-east-1", s3_buckets=frozenset({BUCKET, PROBED})
    )


def test_loads_an_object(s3, policy):
    image = load_image({"s3": f"s3://{BUCKET}/cat.png"}, policy)
    assert (image.mode, image.size, image.getpixel((0, 0))) == ("RGB", (5, 4), (0, 128, 255))


def refusal(uri: str, policy: IntakePolicy) -> tuple[int, bytes]:
    """What the caller is answered for ``uri``: the status and the body's bytes."""
    with pytest.raises(ImageFetchFailed) as raised:
        load_image({"s3": uri}, policy)
    reply = error_response(raised.value)
    return reply.status, json.dumps(reply.payload).encode()


def test_missing_bucket_missing_key_and_denied_object_look_alike(s3, policy, moto_url, monkeypatch):
    """A caller must not learn which buckets and keys exist: the same URI gets the same bytes
    whether its bucket is missing, its key is missing, or the server's role may not read it."""
    uri = f"s3://{PROBED}/cat.png"
    no_bucket = refusal(uri, policy)
    s3.create_bucket(Bucket=PROBED)
    no_key = refusal(uri, policy)
    s3.put_object(Bucket=PROBED, Key="cat.png", Body=PNG)
    iam = boto3.client("iam", endpoint_url=moto_url, region_name="us-east-1")
    iam.create_user(UserName="no-permissions")
    key = iam.create_access_key(UserName="no-permissions")["AccessKey"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
    with enable_iam_authentication():
        denied = refusal(uri, policy)
    assert no_bucket == no_key == denied
    status, body = denied
    assert status == 424 and b"s3:GetObject" in body
    assert not any(code in body for code in (b"NoSuch", b"AccessDenied", b"404", b"403"))


@pytest.fixture
def no_network(monkeypatch) -> list:
    """Every connection attempted, refused: a refusal by policy must come before any."""
    attempts = []

    def connect(self, address):
        attempts.append(address)
        raise OSError("the test allows no connection")

    monkeypatch.setattr(socket.socket, "connect", connect)
    return attempts


@pytest.mark.parametrize(
    "listed, message",
    [((), r"s3:// images are off: intake\.s3_buckets is empty"), (("other-bucket",), "no intake")],
)
def test_an_unlisted_bucket_is_refused_before_any_network_call(no_network, listed, message):
    policy = IntakePolicy(s3_buckets=frozenset(listed))
    with pytest.raises(ImageSourceNotAllowed, match=message) as raised:
        load_image({"s3": f"s3://{BUCKET}/cat.png"}, policy)
    assert error_response(raised.value).status == 403
    assert "intake.s3_buckets" in raised.value.message
    assert no_network == []


@pytest.mark.parametrize(
    "key, permitted",
    [
        ("cats/cat.png", True),
        ("cats/2024/cat.png", True),
        ("catsup.png", False),  # a prefix matches whole path segments only
        ("cats", False),
        ("dogs/cats/cat.png", False),
    ],
)
def test_a_prefix_entry_permits_the_keys_under_it(s3, policy, no_network, key, permitted):
    narrowed = IntakePolicy(**{**vars(policy), "s3_buckets": frozenset({f"{BUCKET}/cats/"})})
    assert narrowed.s3_permits(BUCKET, key) is permitted
    if not permitted:
        with pytest.raises(ImageSourceNotAllowed, match=r"intake\.s3_buckets"):
            load_image({"s3": f"s3://{BUCKET}/{key}"}, narrowed)
        assert no_network == []


def test_an_object_under_a_listed_prefix_loads(s3, policy):
    s3.put_object(Bucket=BUCKET, Key="cats/2024/cat.png", Body=PNG)
    narrowed = IntakePolicy(**{**vars(policy), "s3_buckets": frozenset({f"{BUCKET}/cats"})})
    assert load_image({"s3": f"s3://{BUCKET}/cats/2024/cat.png"}, narrowed).size == (5, 4)


@pytest.mark.parametrize("entry", ["Bad_Bucket", "b", "bucket//cats", "/cats"])
def test_a_malformed_entry_is_refused_when_the_settings_are_built(entry):
    with pytest.raises(ValueError, match=r"intake\.s3_buckets: bad entry"):
        IntakePolicy(s3_buckets=frozenset({entry}))


def test_object_too_large(s3, policy):
    with pytest.raises(ImageTooLarge, match=r"intake\.max_bytes"):
        load_image(
            {"s3": f"s3://{BUCKET}/cat.png"}, IntakePolicy(**{**vars(policy), "max_bytes": 10})
        )


def test_object_that_is_not_an_image(s3, policy):
    with pytest.raises(NotAnImage):
        load_image({"s3": f"s3://{BUCKET}/notes.png"}, policy)


def test_unreachable_endpoint_is_a_fetch_failure(s3):
    policy = IntakePolicy(
        s3_endpoint_url="http://127.0.0.1:9", s3_region="us-east-1", s3_buckets=frozenset({BUCKET})
    )
    with pytest.raises(ImageFetchFailed, match="cannot fetch"):
        load_image({"s3": f"s3://{BUCKET}/cat.png"}, policy)


@pytest.mark.thorough
def test_the_engine_imports_and_serves_without_boto3():
    """The GPU machine and an engine-only install have no boto3: the engine, its settings and
    intake import without it; only an s3:// image needs it, and then says so."""
    blocked = textwrap.dedent(
        """
        import sys
        sys.modules["boto3"] = sys.modules["botocore"] = None  # any import of them fails
        from llava.config import EngineConfig
        from llava.engine import Engine
        from llava.errors import ImageFetchFailed
        from llava.intake import IntakePolicy, load_image
        EngineConfig(model_dir="m", intake={"s3_buckets": ["b-1"]})
        try:
            load_image({"s3": "s3://b-1/k.png"}, IntakePolicy(s3_buckets=frozenset({"b-1"})))
        except ImageFetchFailed as e:
            print(e)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", blocked], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "boto3 is not installed on the server; pip install boto3" in done.stdout
