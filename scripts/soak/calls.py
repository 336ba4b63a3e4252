"""The soak's calls through boto3 and the books of what came back (scripts/soak/__main__.py)."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

from botocore.exceptions import ClientError

from llava_wire import NOT_READY, SESSION_LOST, TURN_INTERRUPTED

# The contract's "send it again" 503s (docs/wire.md §Errors): a worker restarting with its sessions
# (NOT_READY) or one that died under the call (TURN_INTERRUPTED). The soak sends such a call
# again, as a client should, for at most RETRY_FOR_S; the 503 stays in the books.
RETRYABLE = (NOT_READY, TURN_INTERRUPTED)
RETRY_FOR_S = 60.0


# -- calls and what came back --------------------------------------------------------------------
@dataclass
class Outcome:
    kind: str  # open / ask / close / bad:<name> / fault:<name>
    status: int  # what the container (or the endpoint itself) answered: 200, 4xx, 5xx
    code: str  # the error code ("" when 200)
    seconds: float
    at: float  # time.monotonic() when it was sent
    instance: str = ""
    message: str = ""
    wrong: bool | None = None  # None: no answer checked
    retry_after_s: float = 0.0  # the wait a retryable 503 asked for


@dataclass
class Books:
    outcomes: list[Outcome] = field(default_factory=list)
    lost: set[str] = field(default_factory=set)  # ids answered SESSION_LOST
    tiers: dict[str, int] = field(default_factory=dict)  # answers by the tier they came from
    notes: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: Outcome, session_id: str | None) -> Outcome:
        with self.lock:
            self.outcomes.append(outcome)
            if outcome.code == SESSION_LOST:
                self.lost.add(session_id)
        return outcome

    def check(self, outcome: Outcome, reply: dict | None, expected: str) -> bool:
        """Score an answer against what was drawn; False if there was no answer."""
        if reply is None:
            return False
        outcome.wrong = reply["generation"]["text"].strip() != expected
        tier = reply["usage"]["tier"]
        with self.lock:
            self.tiers[tier] = self.tiers.get(tier, 0) + 1
        return True


class Caller:
    """boto3's sagemaker-runtime, unmodified, with retries off so every status is seen."""

    def __init__(self, runtime, name: str, books: Books):
        self.runtime, self.name, self.books = runtime, name, books

    def call(
        self, kind: str, session_id: str | None, body, stream: bool = False, hang_up_after: int = 0
    ) -> tuple[Outcome, dict | None]:
        """One call, sent again after a retryable 503 (booked as ``retried:<kind>``)."""
        give_up_at = time.monotonic() + RETRY_FOR_S
        while True:
            outcome, payload = self._call_once(kind, session_id, body, stream, hang_up_after)
            if outcome.code not in RETRYABLE or time.monotonic() > give_up_at:
                return outcome, payload
            outcome.kind = f"retried:{kind}"
            time.sleep(min(outcome.retry_after_s, 5.0) or 1.0)

    def _call_once(
        self, kind: str, session_id: str | None, body, stream: bool, hang_up_after: int
    ) -> tuple[Outcome, dict | None]:
        began = time.monotonic()
        raw = body if isinstance(body, bytes | str) else json.dumps(body)
        args = {"EndpointName": self.name, "Body": raw, "ContentType": "application/json"}
        if session_id is not None:
            args["SessionId"] = session_id
        try:
            if stream:
                reply = self.runtime.invoke_endpoint_with_response_stream(**args)
                payload = _read_stream(reply["Body"], hang_up_after)
            else:
                reply = self.runtime.invoke_endpoint(**args)
                payload = json.loads(reply["Body"].read() or b"{}")
        except ClientError as err:
            return self.books.add(_failure(kind, err, began), session_id), None
        instance = reply["ResponseMetadata"]["HTTPHeaders"].get("x-local-endpoint-instance", "")
        error = payload.get("error") if isinstance(payload, dict) else None
        if error:  # a stream that failed after it began: its last line says why
            code = str(error.get("code"))
            outcome = Outcome(
                kind,
                503 if code in RETRYABLE else 500,  # the status the contract gives that code
                code,
                time.monotonic() - began,
                began,
                instance,
                str(error.get("message")),
                retry_after_s=float(error.get("retryAfterS") or 0),
            )
            return self.books.add(outcome, session_id), None
        outcome = Outcome(kind, 200, "", time.monotonic() - began, began, instance)
        return self.books.add(outcome, session_id), payload

    def open(self, kind: str, image: dict) -> str | None:
        _, reply = self.call(kind, "NEW_SESSION", {"requestType": "NEW_SESSION", "image": image})
        return None if reply is None else reply["sessionId"]

    def ask_checked(self, kind: str, session_id: str, question: str, expected: str) -> None:
        body = {"requestType": "SESSION", "inputs": question}
        self.books.check(*self.call(kind, session_id, body), expected)

    def close(self, kind: str, session_id: str) -> None:
        self.call(kind, session_id, {"requestType": "CLOSE_SESSION"})


def _read_stream(events, hang_up_after: int) -> dict:
    buffer = b""
    for count, event in enumerate(events, 1):
        if "ModelStreamError" in event:
            return {
                "error": {
                    "code": "ModelStreamError",
                    "message": event["ModelStreamError"].get("Message", ""),
                }
            }
        buffer += event["PayloadPart"]["Bytes"]
        if hang_up_after and count >= hang_up_after:
            events.close()  # the caller hangs up mid-stream
            return {"hungUp": True}
    lines = [json.loads(line) for line in buffer.splitlines() if line.strip()]
    return lines[-1] if lines else {}


def _failure(kind: str, err: ClientError, began: float) -> Outcome:
    response = err.response
    meta = response.get("ResponseMetadata", {})
    headers = meta.get("HTTPHeaders", {})
    status, code = meta.get("HTTPStatusCode", 0), response.get("Error", {}).get("Code", "")
    message = response.get("Error", {}).get("Message", "")
    retry_after_s = 0.0
    if code == "ModelError":  # the container's own status and code
        status = response.get("OriginalStatusCode", status)
        try:
            error = json.loads(response.get("OriginalMessage", ""))["error"]
            code, message = error["code"], error["message"]
            retry_after_s = float(error.get("retryAfterS") or 0)
        except (ValueError, KeyError, TypeError):
            code = f"ModelError/{status}"
    elif headers.get("x-local-endpoint-error-code"):
        code = headers["x-local-endpoint-error-code"]
    return Outcome(
        kind,
        status,
        code,
        time.monotonic() - began,
        began,
        headers.get("x-local-endpoint-instance", ""),
        message,
        retry_after_s=retry_after_s,
    )
