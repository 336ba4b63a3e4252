"""The durable store on S3 (llava/sessions/objects.py ``S3Objects``), against moto's S3 server
on 127.0.0.1 (no AWS here: moto is a real HTTP server speaking S3's API, and boto3 reaches it
unmodified through ``AWS_ENDPOINT_URL_S3``, as on an instance it reaches S3). What only AWS can
tell (IAM on a real bucket, KMS with a customer key's policy) is in docs/deploy.md."""

from __future__ import annotations

import boto3
import pytest

from llava.config import EngineConfig, SettingsError
from llava.engine import Engine
from llava.kv.budget import MemoryBudget
from llava.sessions.durable import record_name
from tests.aws_local import local_aws_env

BUCKET = "durable-sessions"
QUESTIONS = ["What shape is it?", "And its color?", "What color is the shape?"]


@pytest.fixture
def s3(moto_url, monkeypatch):
    local_aws_env(monkeypatch, AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL_S3=moto_url)
    client = boto3.client("s3", endpoint_url=moto_url, region_name="us-east-1")
    if BUCKET not in [b["Name"] for b in client.list_buckets()["Buckets"]]:
        client.create_bucket(Bucket=BUCKET)
    return client


def instance(demo_model, tmp_path, name: str, **settings) -> Engine:
    settings = {"durable_store": f"s3://{BUCKET}/{tmp_path.name}", **settings}
    config = EngineConfig(model_dir="unused", persist_dir=str(tmp_path / name), **settings)
    return Engine(demo_model, config, MemoryBudget(1 << 30))


def test_a_session_resumes_from_s3_on_another_instance(demo_model, sample, tmp_path, s3):
    first = instance(demo_model, tmp_path, "a")
    twin = first.open(sample.image).session_id
    expected = [first.ask(twin, q).token_ids for q in QUESTIONS]
    session_id = first.open(sample.image).session_id
    for question in QUESTIONS[:2]:
        first.ask(session_id, question)
    assert first.flush_durable(10) == []
    first.stop()

    keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET)["Contents"])
    prefix = tmp_path.name
    assert f"{prefix}/{record_name(session_id)}" in keys
    assert [k for k in keys if "/features/" in k] and not [k for k in keys if "/probe/" in k]
    assert all(session_id not in key for key in keys)  # only its hash names it
    head = s3.head_object(Bucket=BUCKET, Key=f"{prefix}/{record_name(session_id)}")
    assert head["ServerSideEncryption"] == "AES256"

    second = instance(demo_model, tmp_path, "b")
    resumed = second.resume(session_id)
    assert second.ask(resumed.session_id, QUESTIONS[2]).token_ids == expected[2]
    second.close(resumed.session_id)
    assert second.flush_durable(10) == []
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET).get("Contents", [])}
    records = {f"{prefix}/{record_name(i)}" for i in (twin, session_id, resumed.session_id)}
    assert keys & records == {f"{prefix}/{record_name(twin)}"}  # resumed from, then closed


def test_writes_are_encrypted_with_the_kms_key_given(demo_model, sample, tmp_path, s3, moto_url):
    kms = boto3.client("kms", endpoint_url=moto_url, region_name="us-east-1")
    key_id = kms.create_key()["KeyMetadata"]["KeyId"]
    engine = instance(demo_model, tmp_path, "a", durable_store_kms_key=key_id)
    session_id = engine.open(sample.image).session_id
    assert engine.flush_durable(10) == []
    head = s3.head_object(Bucket=BUCKET, Key=f"{tmp_path.name}/{record_name(session_id)}")
    assert (head["ServerSideEncryption"], head["SSEKMSKeyId"].split("/")[-1]) == (
        "aws:kms",
        key_id,
    )


def test_a_bucket_that_does_not_exist_fails_the_start_in_one_line(demo_model, tmp_path, s3):
    with pytest.raises(SettingsError, match=r"durable_store: cannot be used: .*NoSuchBucket"):
        instance(demo_model, tmp_path, "a", durable_store="s3://no-such-bucket-here/x")
