"""Create and delete the SageMaker model, endpoint config and endpoint that serve the image.

One endpoint name owns its resources: the model and the endpoint config get the endpoint's
name plus a UTC timestamp (so a redeploy never collides with what is still in use), and
``delete`` finds them again from the endpoint itself, so it needs only the endpoint's name.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import boto3
from botocore.exceptions import ClientError
from sagemaker.core.resources import Endpoint, EndpointConfig, Model
from sagemaker.core.shapes import (
    ContainerDefinition,
    ModelDataSource,
    ProductionVariant,
    S3ModelDataSource,
)
from sagemaker.core.utils.exceptions import FailedStatusError, TimeoutExceededError

from deploy.durable_store import DEFAULT_EXPIRE_DAYS, put_lifecycle, store_environment
from deploy.image_access import check_entries, intake_environment

# The container's setting that names the endpoint in its metrics (serving/emf.py reads it; a
# container cannot learn its endpoint's name from SageMaker).
ENDPOINT_ENV = "SERVE_ENDPOINT_NAME"
# SageMaker's upper bound for both timeouts (ProductionVariant), in seconds.
MAX_TIMEOUT_S = 3600
# The inference AMI whose NVIDIA driver runs the image's torch: PyPI's torch 2.13.0 is a CUDA 13.0
# build, which needs driver 580 or newer, and of the AMIs botocore's model lists only this one
# has it (driver 580, CUDA 13.0). docs/container.md §The image: driver and CUDA.
INFERENCE_AMI_VERSION = "al2023-ami-sagemaker-inference-gpu-4-1"


@dataclass(frozen=True)
class DeploySpec:
    """What to deploy. ``model_data`` is ``s3://bucket/prefix/`` (copied as is to
    /opt/ml/model: no tarball to build or unpack, right for 14 GB checkpoints) or
    ``s3://bucket/key.tar.gz`` (unpacked into /opt/ml/model)."""

    endpoint_name: str
    image: str
    model_data: str
    role_arn: str
    instance_type: str = "ml.g5.2xlarge"
    instance_count: int = 1
    startup_timeout_s: int = 1800  # ContainerStartupHealthCheckTimeoutInSeconds
    download_timeout_s: int = 1800  # ModelDataDownloadTimeoutInSeconds
    environment: dict[str, str] = field(default_factory=dict)  # LLAVA_* settings and the like
    inference_ami_version: str | None = INFERENCE_AMI_VERSION  # None: SageMaker's default AMI
    s3_images: tuple[str, ...] = ()  # intake.s3_buckets: bucket or bucket/prefix entries
    # The durable store (s3://bucket/prefix: LLAVA_DURABLE_STORE), its KMS key, and the days
    # after which its lifecycle rule expires what is under the prefix (docs/deploy.md
    # §The durable store).
    durable_store: str | None = None
    durable_store_kms_key: str | None = None
    durable_store_expire_days: int = DEFAULT_EXPIRE_DAYS

    def __post_init__(self) -> None:
        if not self.model_data.startswith("s3://"):
            raise ValueError(f"model data must be an s3:// URI, not {self.model_data!r}")
        if not (self.model_data.endswith("/") or self.model_data.endswith(".tar.gz")):
            raise ValueError(
                f"model data {self.model_data!r}: give a prefix ending in / or a .tar.gz object"
            )
        if self.instance_count < 1:
            raise ValueError("instance count must be at least 1")
        check_entries(self.s3_images)
        intake_environment(self.s3_images, self.environment)  # refuses a conflict now
        self.store_environment()  # likewise
        if ENDPOINT_ENV in self.environment:
            raise ValueError(f"{ENDPOINT_ENV} is the endpoint's name, set by deploy: leave it out")
        for name, seconds in (
            ("startup", self.startup_timeout_s),
            ("download", self.download_timeout_s),
        ):
            if not 60 <= seconds <= MAX_TIMEOUT_S:
                raise ValueError(f"{name} timeout must be 60..{MAX_TIMEOUT_S} s, not {seconds}")

    def container_environment(self) -> dict[str, str]:
        # The container gives up just before SageMaker does, so the reason is in its log; the
        # endpoint's name tells its metrics from other endpoints' (SageMaker does not tell it).
        return {
            "SERVE_STARTUP_TIMEOUT_S": str(self.startup_timeout_s - 30),
            **self.environment,
            **intake_environment(self.s3_images, self.environment),
            **self.store_environment(),
            ENDPOINT_ENV: self.endpoint_name,
        }

    def store_environment(self) -> dict[str, str]:
        return store_environment(
            self.durable_store,
            self.durable_store_kms_key,
            self.durable_store_expire_days,
            self.environment,
        )

    def model_data_source(self) -> ModelDataSource:
        prefix = self.model_data.endswith("/")
        return ModelDataSource(
            s3_data_source=S3ModelDataSource(
                s3_uri=self.model_data,
                s3_data_type="S3Prefix" if prefix else "S3Object",
                compression_type="None" if prefix else "Gzip",
            )
        )


@dataclass(frozen=True)
class Deployed:
    endpoint_name: str
    endpoint_config_name: str
    model_names: tuple[str, ...]
    status: str
    lifecycle_rule: str | None = None  # the durable store's, as put on its bucket

    def lines(self) -> list[str]:
        return [
            *([f"lifecycle rule   {self.lifecycle_rule}"] if self.lifecycle_rule else []),
            f"model            {', '.join(self.model_names)}",
            f"endpoint config  {self.endpoint_config_name}",
            f"endpoint         {self.endpoint_name} ({self.status})",
        ]


def create(
    spec: DeploySpec,
    session: boto3.Session | None = None,
    wait: bool = True,
    wait_timeout_s: int = 3600,
) -> Deployed:
    """Create model, endpoint config and endpoint; with ``wait``, return once InService.

    If a step fails, what the earlier steps created is deleted. An endpoint that fails while
    starting is left for its logs to be read (SageMaker's reason is in the exception); remove
    it with ``delete``. With a durable store, its lifecycle rule is put first (an S3 refusal
    stops the create before SageMaker is asked anything); it stays on the bucket whatever
    follows, ``delete`` included: it reclaims what the endpoint leaves under the prefix.
    """
    region = session.region_name if session else None
    rule = None
    if spec.durable_store is not None:
        s3 = (session or boto3.Session()).client("s3")
        put = put_lifecycle(s3, spec.durable_store, spec.durable_store_expire_days)
        rule = f"{put['ID']} (objects expire after {spec.durable_store_expire_days} days)"
    name = f"{spec.endpoint_name}-{datetime.now(UTC):%Y%m%d-%H%M%S}"
    created = []  # undone, newest first, if a later step fails: a failed create leaves nothing
    try:
        created.append((Model, {"model_name": name}))
        model = Model.create(
            model_name=name,
            primary_container=ContainerDefinition(
                image=spec.image,
                model_data_source=spec.model_data_source(),
                environment=spec.container_environment(),
            ),
            execution_role_arn=spec.role_arn,
            session=session,
            region=region,
        )
        created.append((EndpointConfig, {"endpoint_config_name": name}))
        config = EndpointConfig.create(
            endpoint_config_name=name,
            production_variants=[
                ProductionVariant(
                    variant_name="AllTraffic",
                    model_name=model.model_name,
                    instance_type=spec.instance_type,
                    initial_instance_count=spec.instance_count,
                    container_startup_health_check_timeout_in_seconds=spec.startup_timeout_s,
                    model_data_download_timeout_in_seconds=spec.download_timeout_s,
                    inference_ami_version=spec.inference_ami_version,
                )
            ],
            session=session,
            region=region,
        )
        endpoint = Endpoint.create(
            endpoint_name=spec.endpoint_name,
            endpoint_config_name=config.endpoint_config_name,
            session=session,
            region=region,
        )
    except Exception:
        for resource, names in reversed(created):  # by name: a create may fail after the fact
            if (found := _get(resource, **names, session=session, region=region)) is not None:
                found.delete()
        raise
    if wait:
        wait_in_service(endpoint, wait_timeout_s)
    endpoint.refresh()
    return Deployed(
        spec.endpoint_name,
        config.endpoint_config_name,
        (model.model_name,),
        endpoint.endpoint_status,
        rule,
    )


# Flushed: through a pipe (a notebook cell, a CI log) each line shows as it is said.
_say_at_once = functools.partial(print, flush=True)


def wait_in_service(
    endpoint: Endpoint,
    timeout_s: float,
    poll_s: float = 15,
    report_s: float = 60,
    say: Callable[[str], None] = _say_at_once,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Poll until the endpoint is InService, saying its status and the time waited whenever the
    status changes and at least every ``report_s``: a start may take most of an hour, and
    sagemaker-core's own waiter draws a live panel that a log or a notebook cell never shows.

    Raises sagemaker-core's ``FailedStatusError`` (with SageMaker's reason) on a failed status
    and ``TimeoutExceededError`` past ``timeout_s``, as its waiter does.
    """
    started = clock()
    said: tuple[str, float] | None = None  # the status last said, and when
    while True:
        endpoint.refresh()
        status, waited = endpoint.endpoint_status, clock() - started
        if said is None or status != said[0] or waited - said[1] >= report_s:
            say(f"endpoint {endpoint.endpoint_name}: {status} after {_duration(waited)}")
            said = (status, waited)
        if status == "InService":
            return
        if "failed" in status.lower():
            raise FailedStatusError(
                resource_type="Endpoint", status=status, reason=endpoint.failure_reason
            )
        if waited >= timeout_s:
            raise TimeoutExceededError(resource_type="Endpoint", status=status)
        sleep(poll_s)


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes} min {seconds:02d} s" if minutes else f"{seconds} s"


def delete(endpoint_name: str, session: boto3.Session | None = None) -> list[str]:
    """Delete the endpoint, its endpoint config and its models; return what was deleted.

    Each step tolerates what is already gone, so a delete that was interrupted can be rerun.
    """
    region = session.region_name if session else None
    deleted = []
    endpoint = _get(Endpoint, endpoint_name=endpoint_name, session=session, region=region)
    if endpoint is None:
        return deleted
    config = _get(
        EndpointConfig,
        endpoint_config_name=endpoint.endpoint_config_name,
        session=session,
        region=region,
    )
    endpoint.delete()
    deleted.append(f"endpoint {endpoint_name}")
    if config is not None:
        models = [v.model_name for v in config.production_variants]
        config.delete()
        deleted.append(f"endpoint config {config.endpoint_config_name}")
        for model_name in models:
            model = _get(Model, model_name=model_name, session=session, region=region)
            if model is not None:
                model.delete()
                deleted.append(f"model {model_name}")
    return deleted


def _get(resource, **names):
    """The resource, or None when SageMaker says it does not exist."""
    try:
        return resource.get(**names)
    except ClientError as e:
        if e.response["Error"]["Code"] in ("ValidationException", "ResourceNotFound"):
            return None
        raise
