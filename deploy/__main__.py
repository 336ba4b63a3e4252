"""``python -m deploy create|delete``: the serving image on a SageMaker real-time endpoint.

    python -m deploy create --name llava-chat --image <ECR image URI> \\
        --model-data s3://bucket/llava-1.5-7b-hf/ --role arn:aws:iam::<account>:role/<role> \\
        [--instance-type ml.g5.2xlarge] [--instance-count 1] \\
        [--startup-timeout 1800] [--download-timeout 1800] \\
        [--env LLAVA_SESSION_TTL_S=600 ...] [--s3-images bucket/prefix ...] \\
        [--durable-store s3://bucket/prefix [--durable-store-kms-key KEY] \\
         [--durable-store-expire-days 2]] \\
        [--inference-ami-version VERSION|default] [--no-wait] [--region eu-west-1]
    python -m deploy delete --name llava-chat [--region eu-west-1]
    python -m deploy image-policy --s3-images bucket/prefix [...]
    python -m deploy store-policy --durable-store s3://bucket/prefix [--durable-store-kms-key ARN]

``create`` prints the names of what it created, one per line, then the endpoint's status and
the time waited at each change and at least every minute, and exits 0 once the endpoint is
InService (1 if it failed, with SageMaker's reason); ``delete`` removes the endpoint with its
endpoint config and models; ``image-policy`` prints the IAM policy that lets the role read
the ``--s3-images`` it serves (nothing else: create never changes IAM); ``store-policy`` the
one that lets it use the ``--durable-store`` (whose S3 lifecycle rule ``create`` puts on the
bucket, beside the bucket's other rules). AWS credentials come from the usual places
(AWS_PROFILE, ...).
"""

from __future__ import annotations

import argparse
import json
import sys

import boto3
from botocore.exceptions import BotoCoreError, ClientError
from sagemaker.core.utils.exceptions import SageMakerCoreError

from deploy.durable_store import DEFAULT_EXPIRE_DAYS, store_policy
from deploy.endpoint import INFERENCE_AMI_VERSION, DeploySpec, create, delete
from deploy.image_access import read_policy


def _env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--env wants KEY=VALUE, not {text!r}")
    return key, value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m deploy",
        description="The serving image on a SageMaker real-time endpoint.",
        epilog="docs/deploy.md: Deploying to SageMaker, step by step",
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--region", help="default: the AWS configuration's region")
    commands = parser.add_subparsers(dest="command", required=True)
    s3_images = argparse.ArgumentParser(add_help=False)
    s3_images.add_argument(
        "--s3-images",
        action="append",
        default=[],
        metavar="BUCKET[/PREFIX]",
        help="where s3:// images may come from (repeatable; none: s3:// images are refused)",
    )
    store = argparse.ArgumentParser(add_help=False)
    store.add_argument(
        "--durable-store",
        metavar="s3://BUCKET/PREFIX",
        help="where sessions outlive their instance (LLAVA_DURABLE_STORE; default: none)",
    )
    store.add_argument(
        "--durable-store-kms-key",
        metavar="KEY",
        help="the KMS key its objects are encrypted with (default: S3's own keys, SSE-S3)",
    )
    up = commands.add_parser(
        "create",
        parents=[common, s3_images, store],
        help="model, endpoint config, endpoint; wait InService",
    )
    up.add_argument("--name", required=True, help="endpoint name (models: name-<timestamp>)")
    up.add_argument("--image", required=True, help="ECR image URI (scripts/build_and_push.sh)")
    up.add_argument("--model-data", required=True, help="s3://bucket/prefix/ or .../x.tar.gz")
    up.add_argument("--role", required=True, help="SageMaker execution role ARN")
    up.add_argument("--instance-type", default="ml.g5.2xlarge")
    up.add_argument("--instance-count", default=1, type=int)
    up.add_argument("--startup-timeout", default=1800, type=int, help="seconds to a 200 /ping")
    up.add_argument("--download-timeout", default=1800, type=int, help="seconds to copy the data")
    up.add_argument("--env", action="append", default=[], type=_env_pair, metavar="KEY=VALUE")
    up.add_argument(
        "--inference-ami-version",
        default=INFERENCE_AMI_VERSION,
        help="the instance's AMI, whose NVIDIA driver must run the image's CUDA build "
        f"(default {INFERENCE_AMI_VERSION}: driver 580, for PyPI's CUDA 13.0 torch); "
        "'default': SageMaker's choice",
    )
    up.add_argument(
        "--durable-store-expire-days",
        default=DEFAULT_EXPIRE_DAYS,
        type=int,
        metavar="DAYS",
        help="the lifecycle rule on --durable-store's prefix: objects expire this many days "
        f"after they were written (default {DEFAULT_EXPIRE_DAYS}; records are refused once "
        "their session's TTL is past anyway; shared features are reclaimed only by this rule)",
    )
    up.add_argument("--no-wait", action="store_true", help="return once creation has started")
    down = commands.add_parser(
        "delete", parents=[common], help="the endpoint, its endpoint config and models"
    )
    down.add_argument("--name", required=True, help="endpoint name")
    commands.add_parser(
        "image-policy", parents=[s3_images], help="the IAM policy to read the --s3-images"
    )
    commands.add_parser(
        "store-policy", parents=[store], help="the IAM policy to use the --durable-store"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "image-policy":  # no AWS call: a document for whoever owns IAM
            print(json.dumps(read_policy(args.s3_images), indent=2))
            return 0
        if args.command == "store-policy":  # the same, for the durable store
            if args.durable_store is None:
                raise ValueError("give the store: --durable-store s3://bucket/prefix")
            policy = store_policy(args.durable_store, args.durable_store_kms_key)
            print(json.dumps(policy, indent=2))
            return 0
        session = boto3.Session(region_name=args.region)
        if args.command == "create":
            spec = DeploySpec(
                endpoint_name=args.name,
                image=args.image,
                model_data=args.model_data,
                role_arn=args.role,
                instance_type=args.instance_type,
                instance_count=args.instance_count,
                startup_timeout_s=args.startup_timeout,
                download_timeout_s=args.download_timeout,
                environment=dict(args.env),
                inference_ami_version=(
                    None if args.inference_ami_version == "default" else args.inference_ami_version
                ),
                s3_images=tuple(args.s3_images),
                durable_store=args.durable_store,
                durable_store_kms_key=args.durable_store_kms_key,
                durable_store_expire_days=args.durable_store_expire_days,
            )
            for line in create(spec, session, wait=not args.no_wait).lines():
                print(line)
        else:
            deleted = delete(args.name, session)
            print("\n".join(f"deleted {what}" for what in deleted) or f"no endpoint {args.name}")
    except ValueError as e:  # a bad argument (DeploySpec's checks)
        print(f"deploy: {e}", file=sys.stderr)
        return 2
    except (ClientError, BotoCoreError, SageMakerCoreError) as e:  # AWS said no, or it failed
        print(f"deploy {args.command}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
