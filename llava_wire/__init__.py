"""The wire contract's names, written once (docs/wire.md §Wire contract): the session headers,
the request types and the error codes a caller can see.

Standard library only and no imports at all: the handler (archived into the .mar beside it),
the container front, the local endpoint, the client and the benchmarks all import it. The
engine keeps its error codes on its error classes (llava/ imports no wire package);
tests/unit/test_wire_names.py checks that each of them is named here.
"""

# SageMaker's session headers (read case-insensitively). An open's reply carries the new id in
# both SESSION_HEADER and NEW_SESSION_HEADER as "<id>; Expires=...".
SESSION_HEADER = "X-Amzn-SageMaker-Session-Id"
NEW_SESSION_HEADER = "X-Amzn-SageMaker-New-Session-Id"
CLOSED_SESSION_HEADER = "X-Amzn-SageMaker-Closed-Session-Id"
# SageMaker passes it through to the container as sent; an open's "tenant=<key>" attribute scopes
# what its session shares (docs/security.md §What sessions share).
CUSTOM_ATTRIBUTES_HEADER = "X-Amzn-SageMaker-Custom-Attributes"

# SageMaker's cap on an InvokeEndpoint body: 6 MB (6,291,456 bytes, botocore's sagemaker-runtime
# model, BodyBlob max); the client, the container front and the local endpoint all hold to it.
MAX_REQUEST_BYTES = 6 * 1024 * 1024

# The body's requestType. NEW_SESSION is also the session header's value that asks for a session.
NEW_SESSION = "NEW_SESSION"
SESSION = "SESSION"
CLOSE_SESSION = "CLOSE_SESSION"
CANCEL_TURN = "CANCEL_TURN"  # the front and the local endpoint send it when a caller hangs up
# CLOSE_SESSION as AWS's stateful-sessions page, LMI and vLLM spell it: the same request.
CLOSE = "CLOSE"
REQUEST_TYPES = (NEW_SESSION, SESSION, CLOSE_SESSION, CLOSE, CANCEL_TURN)

# Error codes: {"error": {"code", "message"}}; the status for each is handlers/errors.py's.
SESSION_NOT_FOUND = "SESSION_NOT_FOUND"
SESSION_CLOSED = "SESSION_CLOSED"
SESSION_EXPIRED = "SESSION_EXPIRED"
SESSION_EVICTED = "SESSION_EVICTED"
SESSION_LOST = "SESSION_LOST"  # the local endpoint: lost with its instance
# A session that no longer exists (closed, expired, evicted, or lost with its instance).
SESSION_GONE_CODES = frozenset(
    {SESSION_NOT_FOUND, SESSION_CLOSED, SESSION_EXPIRED, SESSION_EVICTED, SESSION_LOST}
)
NOT_READY = "NOT_READY"  # the container front: no READY worker behind it now
# The worker died under the call: send it again (503 with Retry-After); the session goes on.
TURN_INTERRUPTED = "TURN_INTERRUPTED"
SHARD_FAILED = "SHARD_FAILED"
INTERNAL_ERROR = "INTERNAL_ERROR"
ENGINE_ERROR = "ENGINE_ERROR"
INVALID_REQUEST = "INVALID_REQUEST"
UNKNOWN_REQUEST_TYPE = "UNKNOWN_REQUEST_TYPE"
MISSING_SESSION_ID = "MISSING_SESSION_ID"
INVALID_SESSION_ID = "INVALID_SESSION_ID"
INPUTS_WITHOUT_SESSION = "INPUTS_WITHOUT_SESSION"
UNKNOWN_KEY = "UNKNOWN_KEY"
REWIND_PAST_START = "REWIND_PAST_START"
SESSION_ID_IN_USE = "SESSION_ID_IN_USE"
CONVERSATION_TOO_LONG = "CONVERSATION_TOO_LONG"
# A turn's image past the session's max_images_per_session (400; nothing of the session changed).
TOO_MANY_IMAGES = "TOO_MANY_IMAGES"
IMAGE_SOURCE_NOT_ALLOWED = "IMAGE_SOURCE_NOT_ALLOWED"
IMAGE_TOO_LARGE = "IMAGE_TOO_LARGE"
NOT_AN_IMAGE = "NOT_AN_IMAGE"
IMAGE_FETCH_FAILED = "IMAGE_FETCH_FAILED"
NO_CAPACITY = "NO_CAPACITY"
KV_MEMORY_FULL = "KV_MEMORY_FULL"
SESSION_BUSY = "SESSION_BUSY"
# The chat-completions API (docs/wire.md §Chat completions)
SESSION_CHANGED = "SESSION_CHANGED"  # a resent conversation met a session that moved on: resend
SYSTEM_CHANGED = "SYSTEM_CHANGED"  # a session keeps its system prompt
UNSUPPORTED_FIELD = "UNSUPPORTED_FIELD"  # a chat-completions field the engine does not do
OVERLOADED = "OVERLOADED"
NOT_FOUND = "NOT_FOUND"  # the container front: a path it does not serve
METHOD_NOT_ALLOWED = "METHOD_NOT_ALLOWED"
REQUEST_TOO_LARGE = "REQUEST_TOO_LARGE"  # a body over MAX_REQUEST_BYTES
# Resuming a session from the durable store (docs/wire.md §Resuming a session)
DURABLE_STORE_OFF = "DURABLE_STORE_OFF"
DURABLE_STORE_UNAVAILABLE = "DURABLE_STORE_UNAVAILABLE"
SESSION_RECORD_NOT_FOUND = "SESSION_RECORD_NOT_FOUND"
SESSION_RECORD_EXPIRED = "SESSION_RECORD_EXPIRED"
SESSION_RECORD_CORRUPT = "SESSION_RECORD_CORRUPT"
SESSION_RECORD_FOREIGN = "SESSION_RECORD_FOREIGN"
RESUME_REFUSED_CODES = frozenset(
    {
        DURABLE_STORE_OFF,
        SESSION_RECORD_NOT_FOUND,
        SESSION_RECORD_EXPIRED,
        SESSION_RECORD_CORRUPT,
        SESSION_RECORD_FOREIGN,
    }
)
ERROR_CODES = (
    SESSION_GONE_CODES
    | {
        NOT_READY,
        TURN_INTERRUPTED,
        SHARD_FAILED,
        INTERNAL_ERROR,
        ENGINE_ERROR,
        INVALID_REQUEST,
        UNKNOWN_REQUEST_TYPE,
        MISSING_SESSION_ID,
        INVALID_SESSION_ID,
        INPUTS_WITHOUT_SESSION,
        UNKNOWN_KEY,
        REWIND_PAST_START,
        SESSION_ID_IN_USE,
        CONVERSATION_TOO_LONG,
        TOO_MANY_IMAGES,
        IMAGE_SOURCE_NOT_ALLOWED,
        IMAGE_TOO_LARGE,
        NOT_AN_IMAGE,
        IMAGE_FETCH_FAILED,
        NO_CAPACITY,
        KV_MEMORY_FULL,
        SESSION_BUSY,
        SESSION_CHANGED,
        SYSTEM_CHANGED,
        UNSUPPORTED_FIELD,
        OVERLOADED,
        NOT_FOUND,
        METHOD_NOT_ALLOWED,
        REQUEST_TOO_LARGE,
        DURABLE_STORE_UNAVAILABLE,
    }
    | RESUME_REFUSED_CODES
)
