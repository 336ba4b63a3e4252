"""Where the durable store keeps its objects: S3 under a prefix, or a directory on a file
system every instance mounts (EFS). Both offer the same four calls, keyed by relative names
such as ``sessions/<hex>``; names are made by llava.sessions.durable alone, from hashes, so no
caller's text reaches one (docs/engine/sessions.md §Durable store).

boto3 is imported only when an S3 store is opened: with ``durable_store`` off, or on a
directory, the engine imports without it.
"""

from __future__ import annotations

import os
import re
import secrets
import time
from pathlib import Path
from typing import Protocol

from llava.config import SettingsError
from llava.files import write_atomically

_NAME = re.compile(r"[a-z]+/[0-9a-f]{64}")  # the only names llava.sessions.durable makes


class StoreError(Exception):
    """The store did not answer, or refused (permissions, throttling, a network error)."""


class ObjectStore(Protocol):
    where: str  # for log lines and messages

    def get(self, name: str) -> bytes | None: ...  # None: no such object
    def put(self, name: str, data: bytes) -> None: ...
    def age_s(self, name: str) -> float | None: ...  # since last written; None: no such object
    def delete(self, name: str) -> None: ...


def _checked(name: str) -> str:
    if not _NAME.fullmatch(name):  # a bug, never a caller's input: names are hashes
        raise ValueError(f"not a durable store name: {name!r}")
    return name


class DirectoryObjects:
    """Objects as files under ``root`` (0700 directories, 0600 files written whole)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.where = str(self.root)

    def _path(self, name: str) -> Path:
        return self.root / _checked(name)

    def get(self, name: str) -> bytes | None:
        try:
            return self._path(name).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"{self.where}: {e.strerror or type(e).__name__}") from None

    def put(self, name: str, data: bytes) -> None:
        path = self._path(name)
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            write_atomically(path, data)
        except OSError as e:
            raise StoreError(f"{self.where}: {e.strerror or type(e).__name__}") from None

    def age_s(self, name: str) -> float | None:
        try:
            return max(0.0, time.time() - self._path(name).stat().st_mtime)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(f"{self.where}: {e.strerror or type(e).__name__}") from None

    def delete(self, name: str) -> None:
        try:
            self._path(name).unlink(missing_ok=True)
        except OSError as e:
            raise StoreError(f"{self.where}: {e.strerror or type(e).__name__}") from None


class S3Objects:
    """Objects under ``s3://bucket/prefix``, encrypted at rest (SSE-KMS with ``kms_key``,
    else SSE-S3). The client is boto3's default chain (the execution role on SageMaker;
    ``AWS_ENDPOINT_URL_S3`` points it elsewhere), with short timeouts: a turn never waits
    on it, but a resume does."""

    def __init__(self, bucket: str, prefix: str, kms_key: str | None):
        import boto3
        from botocore.config import Config

        config = Config(
            connect_timeout=2, read_timeout=10, retries={"max_attempts": 3, "mode": "standard"}
        )
        self.client = boto3.client("s3", config=config)
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.where = f"s3://{bucket}/{self.prefix}"
        self.encryption = (
            {"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": kms_key}
            if kms_key
            else {"ServerSideEncryption": "AES256"}
        )

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{_checked(name)}" if self.prefix else _checked(name)

    def get(self, name: str) -> bytes | None:
        try:
            return self._call("get_object", Key=self._key(name))["Body"].read()
        except _Absent:
            return None

    def put(self, name: str, data: bytes) -> None:
        self._call("put_object", Key=self._key(name), Body=data, **self.encryption)

    def age_s(self, name: str) -> float | None:
        try:
            written = self._call("head_object", Key=self._key(name))["LastModified"]
        except _Absent:
            return None
        return max(0.0, time.time() - written.timestamp())

    def delete(self, name: str) -> None:
        self._call("delete_object", Key=self._key(name))

    def _call(self, operation: str, **kwargs):
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return getattr(self.client, operation)(Bucket=self.bucket, **kwargs)
        except ClientError as e:
            error = e.response.get("Error", {})
            if error.get("Code") in ("NoSuchKey", "404", "NotFound"):
                raise _Absent from None
            raise StoreError(f"{self.where}: {error.get('Code')}: {error.get('Message')}") from None
        except (BotoCoreError, OSError) as e:
            raise StoreError(f"{self.where}: {type(e).__name__}: {e}") from None


class _Absent(Exception):
    """S3 has no such key."""


def open_objects(setting: str, kms_key: str | None) -> ObjectStore:
    """The store ``durable_store`` names, tried at start: an object written, read back and
    deleted under ``probe/``, so a store this worker cannot use (no bucket, no permission, a
    directory it cannot write) fails the start in one line, never a resume later."""
    if setting.startswith("s3://"):
        bucket, _, prefix = setting.removeprefix("s3://").partition("/")
        store: ObjectStore = S3Objects(bucket, prefix, kms_key)
    else:
        store = DirectoryObjects(setting)
    probe = f"probe/{secrets.token_hex(32)}"
    data = f"probe from pid {os.getpid()}".encode()
    try:
        store.put(probe, data)
        read = store.get(probe)
        store.delete(probe)
    except StoreError as e:
        raise SettingsError("durable_store", f"cannot be used: {e}") from None
    if read != data:
        raise SettingsError("durable_store", f"{store.where} did not give back what was written")
    return store
