"""The AWS event-stream framing of ``InvokeEndpointWithResponseStream`` replies.

A message is: total length (u32), headers length (u32), CRC32 of those 8 bytes, headers,
payload, CRC32 of everything before it; big-endian. Each header is name length (u8), name,
type (7 = string), value length (u16), value. botocore's ``EventStreamBuffer`` decodes it.
"""

from __future__ import annotations

import json
import struct
import zlib

_STRING = 7


def encode_message(headers: dict[str, str], payload: bytes) -> bytes:
    encoded = b"".join(_header(name, value) for name, value in headers.items())
    total = 12 + len(encoded) + len(payload) + 4
    prelude = struct.pack(">II", total, len(encoded))
    message = prelude + struct.pack(">I", zlib.crc32(prelude)) + encoded + payload
    return message + struct.pack(">I", zlib.crc32(message))


def payload_part(data: bytes) -> bytes:
    """A ``PayloadPart`` event: a piece of the container's reply, split wherever it fell."""
    return encode_message(
        {
            ":message-type": "event",
            ":event-type": "PayloadPart",
            ":content-type": "application/octet-stream",
        },
        data,
    )


def model_stream_error(message: str, error_code: str) -> bytes:
    """The ``ModelStreamError`` exception event: the stream broke after it began."""
    return encode_message(
        {
            ":message-type": "exception",
            ":exception-type": "ModelStreamError",
            ":content-type": "application/json",
        },
        json.dumps({"Message": message, "ErrorCode": error_code}).encode(),
    )


def _header(name: str, value: str) -> bytes:
    raw_name, raw_value = name.encode(), value.encode()
    return (
        struct.pack(">B", len(raw_name))
        + raw_name
        + struct.pack(">BH", _STRING, len(raw_value))
        + raw_value
    )
