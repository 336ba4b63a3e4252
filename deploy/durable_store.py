"""The durable store on S3 for ``python -m deploy``: the container's settings, the lifecycle rule
that reclaims what sessions leave under the prefix, and the IAM policy its role needs
(docs/deploy.md §The durable store).

The container writes ``<prefix>/sessions/<sha256 of a session id>`` (one record a session,
deleted on close and expiry, refused past the session's TTL) and ``<prefix>/features/<sha256>``
(each image's features once, shared by every session on that image, written only if absent):
nothing but this rule ever deletes a features object.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from botocore.exceptions import ClientError

STORE_ENV = "LLAVA_DURABLE_STORE"
KMS_ENV = "LLAVA_DURABLE_STORE_KMS_KEY"
TTL_ENV = "LLAVA_SESSION_TTL_S"
PERSIST_ENV = "LLAVA_PERSIST_DIR"
# Objects under the prefix expire this many days after they were written (S3 counts from an
# object's creation, rounded up to the next midnight UTC): long past any record's TTL (20 min by
# default), short enough that the features of images nobody asks about any more go soon.
DEFAULT_EXPIRE_DAYS = 2
# A record is a single PUT, a features object may be a multipart one: parts of an upload that
# never completed (the worker was killed) are billed until this aborts them.
ABORT_MULTIPART_DAYS = 1
RULE_ID = "llava-durable-store"  # + ":" + the prefix (S3 allows 255 characters)


def split_store(uri: str) -> tuple[str, str]:
    """``s3://bucket/prefix`` → (bucket, "prefix/"). A prefix is required: the lifecycle rule
    expires everything under it, and a bucket's root is nobody's to expire."""
    if not uri.startswith("s3://"):
        raise ValueError(
            f"--durable-store wants s3://bucket/prefix, not {uri!r} (a directory store is for a "
            "shared file system, which a SageMaker real-time endpoint does not mount)"
        )
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    prefix = prefix.strip("/")
    if not bucket or not prefix:
        raise ValueError(f"--durable-store wants s3://bucket/prefix with a prefix, not {uri!r}")
    return bucket, prefix + "/"


def store_environment(
    uri: str | None, kms_key: str | None, expire_days: int, environment: Mapping[str, str]
) -> dict[str, str]:
    """The container's ``LLAVA_DURABLE_STORE`` (and KMS key) settings; refuses what cannot work
    before any AWS call: the settings given twice, no persistent tier, a TTL the rule cuts."""
    for name in (STORE_ENV, KMS_ENV):
        if name in environment:  # it would go without its lifecycle rule, or twice
            raise ValueError(f"give the durable store with --durable-store, not --env {name}")
    if uri is None:
        if kms_key is not None:
            raise ValueError("--durable-store-kms-key needs --durable-store")
        return {}
    split_store(uri)
    if environment.get(PERSIST_ENV) == "null":
        raise ValueError(f"--durable-store needs the persistent tier: drop {PERSIST_ENV}=null")
    if expire_days < 1:
        raise ValueError(f"--durable-store-expire-days must be at least 1, not {expire_days}")
    ttl = environment.get(TTL_ENV)
    if ttl is not None and _float(ttl) >= expire_days * 86400:
        raise ValueError(
            f"{TTL_ENV}={ttl} outlives --durable-store-expire-days {expire_days}: the lifecycle "
            "rule would delete live sessions' records"
        )
    return {STORE_ENV: uri} | ({KMS_ENV: kms_key} if kms_key is not None else {})


def lifecycle_rule(prefix: str, expire_days: int) -> dict:
    """The one rule on the store's prefix: expire objects, abort stale multipart uploads."""
    rule_id = f"{RULE_ID}:{prefix}"
    if len(rule_id) > 255:
        rule_id = f"{RULE_ID}:{hashlib.sha256(prefix.encode()).hexdigest()}"
    return {
        "ID": rule_id,
        "Filter": {"Prefix": prefix},
        "Status": "Enabled",
        "Expiration": {"Days": expire_days},
        "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": ABORT_MULTIPART_DAYS},
    }


def put_lifecycle(s3, uri: str, expire_days: int) -> dict:
    """Add (or update) the store's rule to the bucket's lifecycle configuration, keeping every
    other rule: S3 replaces the whole configuration on a put, so it is read first. Not atomic
    (S3 offers no conditional put here): a concurrent edit of the same bucket's rules can be
    lost. Returns the rule."""
    bucket, prefix = split_store(uri)
    ours = lifecycle_rule(prefix, expire_days)
    try:
        current = s3.get_bucket_lifecycle_configuration(Bucket=bucket)
    except ClientError as err:
        if err.response.get("Error", {}).get("Code") != "NoSuchLifecycleConfiguration":
            raise
        current = {}
    rules = [rule for rule in current.get("Rules", []) if rule.get("ID") != ours["ID"]]
    # The bucket's setting for its transition rules, kept as it was.
    size = "TransitionDefaultMinimumObjectSize"
    options = {size: current[size]} if size in current else {}
    s3.put_bucket_lifecycle_configuration(
        Bucket=bucket, LifecycleConfiguration={"Rules": [*rules, ours]}, **options
    )
    return ours


def store_policy(uri: str, kms_key_arn: str | None = None) -> dict:
    """The least IAM policy for the execution role on the store: read, write and delete
    objects under the prefix; list the bucket only under it (without s3:ListBucket, S3
    answers a GET or HEAD of a missing key 403 instead of 404, and a missing record or
    features object would read as a refusal); the KMS key's data keys when one is set."""
    bucket, prefix = split_store(uri)
    statements = [
        {
            "Sid": "LlavaDurableStoreObjects",
            "Effect": "Allow",
            "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"],
            "Resource": f"arn:aws:s3:::{bucket}/{prefix}*",
        },
        {
            "Sid": "LlavaDurableStoreList",
            "Effect": "Allow",
            "Action": "s3:ListBucket",
            "Resource": f"arn:aws:s3:::{bucket}",
            "Condition": {"StringLike": {"s3:prefix": [f"{prefix}*"]}},
        },
    ]
    if kms_key_arn is not None:
        if not kms_key_arn.startswith("arn:aws"):
            raise ValueError(
                f"the policy names the KMS key by its ARN, not {kms_key_arn!r} (an alias or key "
                "id is fine for the container's setting, not for IAM)"
            )
        statements.append(
            {
                "Sid": "LlavaDurableStoreKey",
                "Effect": "Allow",
                "Action": ["kms:GenerateDataKey", "kms:Decrypt"],
                "Resource": kms_key_arn,
            }
        )
    return {"Version": "2012-10-17", "Statement": statements}


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{TTL_ENV} must be a number of seconds, not {text!r}") from None
