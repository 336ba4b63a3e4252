"""``python -m deploy`` against moto's SageMaker, a real HTTP server on loopback.

The control plane is mocked only because no AWS account exists here: boto3 and sagemaker-core
make their real requests (AWS_ENDPOINT_URL_SAGEMAKER points them at moto). What moto cannot
show — an image pulled, model data copied, /ping polled, an endpoint InService for real — is
in the table of docs/deploy.md §What only AWS can verify.
"""

from __future__ import annotations

import json
import logging

import pytest
import requests
from moto.core.responses import ActionResult
from moto.sagemaker.responses import SageMakerResponse
from moto.server import ThreadedMotoServer

from serving.emf import endpoint_name
from serving.torchserve import free_ports

IMAGE = "123456789012.dkr.ecr.eu-west-1.amazonaws.com/stateful-llava:v1"
ROLE = "arn:aws:iam::123456789012:role/sagemaker"
# moto (5.2) knows only older instance types: no ml.g5.*.
INSTANCE = "ml.g4dn.xlarge"
# A moto server and sagemaker-core's first requests: seconds in each process that runs any of
# these, so make test runs them and make test-fast leaves them out.
pytestmark = pytest.mark.thorough


def _omit_empty(describe):
    """moto answers ``"VpcConfig": {}`` / ``"DataCaptureConfig": {}`` where AWS omits the key,
    and sagemaker-core's typed shapes reject an empty one: answer as AWS does."""

    def patched(self) -> ActionResult:
        result = describe(self).result
        return ActionResult({k: v for k, v in result.items() if v != {}})

    return patched


@pytest.fixture(scope="module")
def moto_port():
    """One moto server for the module (stopping one takes half a second); each test resets it."""
    (port,) = free_ports(1)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # its access log outlives capture
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield port
    server.stop()


@pytest.fixture
def sagemaker(monkeypatch, moto_port):
    for name in ("describe_model", "describe_endpoint_config", "describe_endpoint"):
        monkeypatch.setattr(SageMakerResponse, name, _omit_empty(getattr(SageMakerResponse, name)))
    port = moto_port
    requests.post(f"http://127.0.0.1:{port}/moto-api/reset", timeout=10).raise_for_status()
    for key, value in {
        "AWS_ENDPOINT_URL_SAGEMAKER": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "eu-west-1",
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    import boto3

    return boto3.client("sagemaker", region_name="eu-west-1")


def deploy(*args: str) -> int:
    from deploy.__main__ import main

    return main(list(args))


def create_args(name: str = "llava-chat", **overrides: str) -> list[str]:
    options = {
        "--name": name,
        "--image": IMAGE,
        "--model-data": "s3://bucket/llava-1.5-7b-hf/",
        "--role": ROLE,
        "--instance-type": INSTANCE,
        **overrides,
    }
    return ["create", *[part for pair in options.items() for part in pair]]


def everything(sm) -> dict[str, list[str]]:
    return {
        "models": [m["ModelName"] for m in sm.list_models()["Models"]],
        "configs": [c["EndpointConfigName"] for c in sm.list_endpoint_configs()["EndpointConfigs"]],
        "endpoints": [e["EndpointName"] for e in sm.list_endpoints()["Endpoints"]],
    }


def test_create_makes_model_config_endpoint_as_asked_and_delete_removes_them(sagemaker, capsys):
    args = create_args(**{"--instance-count": "2", "--startup-timeout": "2400"})
    assert deploy(*args, "--env", "LLAVA_SESSION_TTL_S=600", "--env", "LLAVA_DEVICE=cuda") == 0
    printed = capsys.readouterr().out
    made = everything(sagemaker)
    assert made["endpoints"] == ["llava-chat"]
    [model_name] = made["models"]
    assert made["configs"] == [model_name] and model_name.startswith("llava-chat-")
    assert model_name in printed and "llava-chat (InService)" in printed
    assert "endpoint llava-chat: InService after 0 s" in printed  # the wait's progress line

    container = sagemaker.describe_model(ModelName=model_name)["PrimaryContainer"]
    assert container["Image"] == IMAGE
    assert container["ModelDataSource"]["S3DataSource"] == {
        "S3Uri": "s3://bucket/llava-1.5-7b-hf/",
        "S3DataType": "S3Prefix",  # a checkpoint copied as is: no tarball for 14 GB
        "CompressionType": "None",
    }
    assert container["Environment"] == {
        "SERVE_STARTUP_TIMEOUT_S": "2370",  # the container gives up before SageMaker does
        "LLAVA_SESSION_TTL_S": "600",
        "LLAVA_DEVICE": "cuda",
        "SERVE_ENDPOINT_NAME": "llava-chat",  # its metrics' Endpoint dimension
    }
    assert endpoint_name(container["Environment"]) == "llava-chat"  # as the container reads it
    [variant] = sagemaker.describe_endpoint_config(EndpointConfigName=model_name)[
        "ProductionVariants"
    ]
    assert variant["ModelName"] == model_name
    assert (variant["InstanceType"], variant["InitialInstanceCount"]) == (INSTANCE, 2)
    assert variant["ContainerStartupHealthCheckTimeoutInSeconds"] == 2400
    assert variant["ModelDataDownloadTimeoutInSeconds"] == 1800
    # driver 580 (botocore's model of the AMIs): what the image's CUDA 13.0 torch needs
    assert variant["InferenceAmiVersion"] == "al2023-ami-sagemaker-inference-gpu-4-1"

    assert deploy("delete", "--name", "llava-chat") == 0
    assert f"deleted model {model_name}" in capsys.readouterr().out
    assert everything(sagemaker) == {"models": [], "configs": [], "endpoints": []}
    assert deploy("delete", "--name", "llava-chat") == 0  # deleting again: nothing to do
    assert "no endpoint llava-chat" in capsys.readouterr().out


def test_s3_images_reach_the_container_as_its_intake_setting(sagemaker):
    """--s3-images become intake.s3_buckets in LLAVA_INTAKE, beside what --env's LLAVA_INTAKE
    says; the container merges that with its archived intake settings key by key."""
    from llava.config import load_config
    from llava.intake import IntakePolicy

    intake = json.dumps({"allow": ["10.0.0.0/8"]})
    args = create_args(**{"--s3-images": "chat-images/uploads"})
    assert deploy(*args, "--s3-images", "shared-art", "--env", f"LLAVA_INTAKE={intake}") == 0
    [model] = everything(sagemaker)["models"]
    environment = sagemaker.describe_model(ModelName=model)["PrimaryContainer"]["Environment"]
    assert json.loads(environment["LLAVA_INTAKE"]) == {
        "allow": ["10.0.0.0/8"],
        "s3_buckets": ["chat-images/uploads", "shared-art"],
    }
    archived = {"model_dir": "m", "intake": {"max_redirects": 1}}
    policy = IntakePolicy.from_mapping(load_config(archived, environment, "/opt/ml/model").intake)
    assert policy.max_redirects == 1 and policy.allow == ("10.0.0.0/8",)
    assert policy.s3_permits("chat-images", "uploads/cat.png")
    assert not policy.s3_permits("chat-images", "private/cat.png")


def test_without_s3_images_the_container_refuses_s3_sources(sagemaker):
    assert deploy(*create_args()) == 0
    [model] = everything(sagemaker)["models"]
    environment = sagemaker.describe_model(ModelName=model)["PrimaryContainer"]["Environment"]
    assert "LLAVA_INTAKE" not in environment  # intake.s3_buckets keeps its default: none


def test_the_image_policy_grants_reading_exactly_the_listed_places(capsys):
    assert deploy("image-policy", "--s3-images", "chat-images/uploads/", "--s3-images", "art") == 0
    [statement] = json.loads(capsys.readouterr().out)["Statement"]
    assert statement["Effect"] == "Allow" and statement["Action"] == "s3:GetObject"
    assert statement["Resource"] == ["arn:aws:s3:::chat-images/uploads/*", "arn:aws:s3:::art/*"]


def test_the_ami_can_be_left_to_sagemaker(sagemaker):
    """For an image built with --torch-index for a CUDA 12.x that SageMaker's default AMI runs."""
    assert deploy(*create_args(**{"--inference-ami-version": "default"})) == 0
    [config] = everything(sagemaker)["configs"]
    [variant] = sagemaker.describe_endpoint_config(EndpointConfigName=config)["ProductionVariants"]
    assert "InferenceAmiVersion" not in variant


def test_tarball_model_data_is_unpacked(sagemaker):
    assert deploy(*create_args(**{"--model-data": "s3://bucket/demo/model.tar.gz"})) == 0
    [model] = everything(sagemaker)["models"]
    source = sagemaker.describe_model(ModelName=model)["PrimaryContainer"]["ModelDataSource"]
    assert source["S3DataSource"]["S3DataType"] == "S3Object"
    assert source["S3DataSource"]["CompressionType"] == "Gzip"


def test_delete_leaves_other_endpoints_alone(sagemaker):
    assert deploy(*create_args("llava-a")) == 0
    assert deploy(*create_args("llava-b")) == 0
    assert deploy("delete", "--name", "llava-a") == 0
    left = everything(sagemaker)
    assert left["endpoints"] == ["llava-b"]
    assert all(name.startswith("llava-b-") for name in left["models"] + left["configs"])


def test_a_failed_step_leaves_nothing_behind(sagemaker, capsys):
    # moto, like SageMaker, refuses an unknown instance type at CreateEndpointConfig: by then
    # the model exists, and create must delete it again.
    assert deploy(*create_args(**{"--instance-type": "ml.nonexistent.xlarge"})) == 1
    assert "instanceType" in capsys.readouterr().err
    assert everything(sagemaker) == {"models": [], "configs": [], "endpoints": []}


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"--model-data": "/local/dir"}, "must be an s3:// URI"),
        ({"--model-data": "s3://bucket/model.zip"}, "prefix ending in /"),
        ({"--startup-timeout": "7200"}, "startup timeout must be 60..3600"),
        ({"--instance-count": "0"}, "at least 1"),
        ({"--s3-images": "s3://chat-images/uploads"}, "bucket or bucket/prefix"),
    ],
)
def test_bad_arguments_fail_before_any_call(sagemaker, capsys, overrides, message):
    assert deploy(*create_args(**overrides)) == 2
    assert message in capsys.readouterr().err
    assert everything(sagemaker) == {"models": [], "configs": [], "endpoints": []}


def test_the_endpoint_name_is_deploys_to_set(sagemaker, capsys):
    """Another value would file the endpoint's metrics under another endpoint."""
    assert deploy(*create_args(), "--env", "SERVE_ENDPOINT_NAME=other") == 2
    assert "SERVE_ENDPOINT_NAME is the endpoint's name, set by deploy" in capsys.readouterr().err
    assert everything(sagemaker) == {"models": [], "configs": [], "endpoints": []}


def test_s3_images_given_twice_are_refused(sagemaker, capsys):
    intake = json.dumps({"s3_buckets": ["other"]})
    assert deploy(*create_args(**{"--s3-images": "b"}), "--env", f"LLAVA_INTAKE={intake}") == 2
    assert "give the buckets once" in capsys.readouterr().err
    assert everything(sagemaker) == {"models": [], "configs": [], "endpoints": []}


def test_env_must_be_key_value(capsys):
    with pytest.raises(SystemExit):
        deploy(*create_args(), "--env", "LLAVA_DEVICE")
    assert "--env wants KEY=VALUE" in capsys.readouterr().err


def test_the_default_ami_is_one_botocore_lists_with_the_driver_cuda_13_needs():
    """The facts behind INFERENCE_AMI_VERSION, read from the installed botocore's SageMaker
    model: CUDA 13.0 needs NVIDIA driver 580 or newer (NVIDIA's CUDA 13.0 release notes)."""
    from botocore.loaders import Loader

    from deploy.endpoint import INFERENCE_AMI_VERSION

    shapes = Loader().load_service_model("sagemaker", "service-2")["shapes"]
    assert INFERENCE_AMI_VERSION in shapes["ProductionVariantInferenceAmiVersion"]["enum"]
    docs = shapes["ProductionVariant"]["members"]["InferenceAmiVersion"]["documentation"]
    ours = docs.split(f"<dt>{INFERENCE_AMI_VERSION}</dt>", 1)[1].split("</dd>", 1)[0]
    assert "NVIDIA driver version: 580" in ours and "CUDA version: 13.0" in ours


class StartingEndpoint:
    """An endpoint whose describes answer ``statuses`` in turn (the last one for ever), on a
    clock that only the waiter's sleeps advance."""

    endpoint_name = "llava-chat"
    failure_reason = "CannotStartContainerError: /ping did not return 200"

    def __init__(self, *statuses: str):
        self.statuses, self.now = list(statuses), 0.0

    def refresh(self) -> None:
        self.endpoint_status = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def wait(endpoint: StartingEndpoint, timeout_s: float = 3600) -> list[str]:
    from deploy.endpoint import wait_in_service

    said: list[str] = []
    wait_in_service(
        endpoint, timeout_s, say=said.append, clock=lambda: endpoint.now, sleep=endpoint.sleep
    )
    return said


def test_the_wait_for_in_service_says_the_status_and_time_at_each_change_and_every_minute():
    endpoint = StartingEndpoint(*["Creating"] * 9, "InService")  # a poll every 15 s
    assert wait(endpoint) == [
        "endpoint llava-chat: Creating after 0 s",
        "endpoint llava-chat: Creating after 1 min 00 s",
        "endpoint llava-chat: Creating after 2 min 00 s",
        "endpoint llava-chat: InService after 2 min 15 s",
    ]


def test_the_wait_stops_at_a_failed_status_with_sagemakers_reason():
    from sagemaker.core.utils.exceptions import FailedStatusError

    endpoint = StartingEndpoint("Creating", "Creating", "Failed")
    with pytest.raises(FailedStatusError, match="CannotStartContainerError"):
        wait(endpoint)
    assert endpoint.now == 30  # no further sleep once it failed


def test_the_wait_gives_up_at_its_timeout():
    from sagemaker.core.utils.exceptions import TimeoutExceededError

    endpoint = StartingEndpoint("Creating")
    with pytest.raises(TimeoutExceededError, match="Creating"):
        wait(endpoint, timeout_s=100)
    assert endpoint.now == 105  # polled at 0, 15, ..., 105: the first poll past 100 s


def test_deploy_names_the_setting_the_container_reads_for_its_endpoint():
    from deploy.endpoint import ENDPOINT_ENV
    from serving import emf

    assert ENDPOINT_ENV == emf.ENDPOINT_ENV


# The durable store: moto is the AWS control plane here too (its S3, on the same server): the
# lifecycle call is boto3's real request; what S3 does with the rule (expiring objects days
# later) and IAM's answers are in docs/deploy.md §What only AWS can verify.
STORE_BUCKET = "llava-sessions"
KEY_ARN = "arn:aws:kms:eu-west-1:123456789012:key/1234abcd-12ab-34cd-56ef-1234567890ab"
THEIR_RULES = [
    {
        "ID": "logs-30-days",
        "Filter": {"Prefix": "logs/"},
        "Status": "Enabled",
        "Expiration": {"Days": 30},
    },
    {
        "ID": "archive",
        "Filter": {"Prefix": "archive/"},
        "Status": "Enabled",
        "Transitions": [{"Days": 90, "StorageClass": "GLACIER"}],
    },
]


@pytest.fixture
def s3(sagemaker, monkeypatch, moto_port):
    """The store's bucket on moto (reset with SageMaker), holding rules of its own."""
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{moto_port}")
    import boto3

    client = boto3.client("s3", region_name="eu-west-1")
    client.create_bucket(
        Bucket=STORE_BUCKET, CreateBucketConfiguration={"LocationConstraint": "eu-west-1"}
    )
    client.put_bucket_lifecycle_configuration(
        Bucket=STORE_BUCKET, LifecycleConfiguration={"Rules": THEIR_RULES}
    )
    return client


def rules(s3, bucket: str = STORE_BUCKET) -> dict[str, dict]:
    return {r["ID"]: r for r in s3.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]}


def test_a_durable_store_reaches_the_container_and_its_rule_joins_the_buckets_rules(
    sagemaker, s3, capsys
):
    from llava.config import load_config

    store = f"s3://{STORE_BUCKET}/chat/"
    args = create_args(**{"--durable-store": store, "--durable-store-kms-key": KEY_ARN})
    assert deploy(*args) == 0
    assert "lifecycle rule   llava-durable-store:chat/ (objects expire after 2 days)" in (
        capsys.readouterr().out
    )
    [model] = everything(sagemaker)["models"]
    environment = sagemaker.describe_model(ModelName=model)["PrimaryContainer"]["Environment"]
    assert environment["LLAVA_DURABLE_STORE"] == store
    assert environment["LLAVA_DURABLE_STORE_KMS_KEY"] == KEY_ARN
    archived = {"model_dir": "m", "persist_dir": "/dev/shm/stateful-llava"}
    config = load_config(archived, environment, "/opt/ml/model")  # as the container reads it
    assert (config.durable_store, config.durable_store_kms_key) == (store, KEY_ARN)

    held = rules(s3)
    assert {k: held[k] for k in ("logs-30-days", "archive")} == {r["ID"]: r for r in THEIR_RULES}
    assert held["llava-durable-store:chat/"] == {
        "ID": "llava-durable-store:chat/",
        "Filter": {"Prefix": "chat/"},  # "chat/" only: not "chat-old/"
        "Status": "Enabled",
        "Expiration": {"Days": 2},
        "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 1},
    }

    # Another endpoint on the same store with other days: the rule is replaced, not added.
    args = create_args("llava-b", **{"--durable-store": store})
    assert deploy(*args, "--durable-store-expire-days", "5") == 0
    held = rules(s3)
    assert sorted(held) == ["archive", "llava-durable-store:chat/", "logs-30-days"]
    assert held["llava-durable-store:chat/"]["Expiration"] == {"Days": 5}
    [model_b] = [m for m in everything(sagemaker)["models"] if m.startswith("llava-b-")]
    environment = sagemaker.describe_model(ModelName=model_b)["PrimaryContainer"]["Environment"]
    assert "LLAVA_DURABLE_STORE_KMS_KEY" not in environment  # S3's own keys (SSE-S3)
    assert deploy("delete", "--name", "llava-chat") == 0
    assert "llava-durable-store:chat/" in rules(s3)  # it reclaims what the endpoint left


def test_a_bucket_without_lifecycle_rules_gets_the_stores_alone(sagemaker, s3):
    s3.create_bucket(Bucket="bare", CreateBucketConfiguration={"LocationConstraint": "eu-west-1"})
    assert deploy(*create_args(**{"--durable-store": "s3://bare/a/b"})) == 0
    assert list(rules(s3, "bare")) == ["llava-durable-store:a/b/"]


def test_a_store_s3_refuses_stops_the_create_before_sagemaker_is_asked(sagemaker, s3, capsys):
    assert deploy(*create_args(**{"--durable-store": "s3://no-such-bucket/chat"})) == 1
    assert "NoSuchBucket" in capsys.readouterr().err
    assert everything(sagemaker) == {"models": [], "configs": [], "endpoints": []}


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--durable-store", f"s3://{STORE_BUCKET}"], "with a prefix"),
        (["--durable-store", "/mnt/efs/sessions"], "does not mount"),
        (["--durable-store-kms-key", KEY_ARN], "--durable-store-kms-key needs --durable-store"),
        (
            ["--durable-store", f"s3://{STORE_BUCKET}/c", "--durable-store-expire-days", "0"],
            "at least 1",
        ),
        (["--env", f"LLAVA_DURABLE_STORE=s3://{STORE_BUCKET}/c"], "not --env LLAVA_DURABLE_STORE"),
        (
            ["--durable-store", f"s3://{STORE_BUCKET}/c", "--env", "LLAVA_PERSIST_DIR=null"],
            "needs the persistent tier",
        ),
        (
            ["--durable-store", f"s3://{STORE_BUCKET}/c", "--env", "LLAVA_SESSION_TTL_S=172800"],
            "outlives --durable-store-expire-days 2",
        ),
    ],
)
def test_bad_durable_store_arguments_fail_before_any_call(sagemaker, s3, capsys, extra, message):
    assert deploy(*create_args(), *extra) == 2
    assert message in capsys.readouterr().err
    assert everything(sagemaker) == {"models": [], "configs": [], "endpoints": []}
    assert sorted(rules(s3)) == ["archive", "logs-30-days"]


def test_the_store_policy_grants_the_prefix_and_its_key_only(capsys):
    store = f"s3://{STORE_BUCKET}/chat"
    assert deploy("store-policy", "--durable-store", store, "--durable-store-kms-key", KEY_ARN) == 0
    objects, listing, key = json.loads(capsys.readouterr().out)["Statement"]
    assert objects["Action"] == ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"]
    assert objects["Resource"] == f"arn:aws:s3:::{STORE_BUCKET}/chat/*"
    # without it S3 answers a missing record 403, not 404; listed under the prefix only
    assert (listing["Action"], listing["Resource"]) == (
        "s3:ListBucket",
        f"arn:aws:s3:::{STORE_BUCKET}",
    )
    assert listing["Condition"] == {"StringLike": {"s3:prefix": ["chat/*"]}}
    assert key["Action"] == ["kms:GenerateDataKey", "kms:Decrypt"] and key["Resource"] == KEY_ARN
    assert (
        deploy("store-policy", "--durable-store", store, "--durable-store-kms-key", "alias/x") == 2
    )
    assert "by its ARN" in capsys.readouterr().err
