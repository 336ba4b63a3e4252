"""What the entrypoint's tests and the image's tests both ask of a running container: its
front's /ping and /invocations, and the READY worker on TorchServe's management API (with its
key, which each kind of container reads in its own way: ``management_auth``)."""

from __future__ import annotations

import requests

SESSION = "X-Amzn-SageMaker-Session-Id"


class FrontClient:
    """``url``: the front (the public port); ``management_url``: TorchServe's management API."""

    url: str
    management_url: str

    def ping(self) -> int | None:
        try:
            return requests.get(f"{self.url}/ping", timeout=10).status_code
        except requests.ConnectionError:
            return None  # the front is not listening yet (or any more)

    def management_auth(self) -> dict[str, str]:
        """TorchServe's management key header, read anew: a restart makes new keys."""
        raise NotImplementedError

    def ready_worker_pid(self) -> int | None:
        """The READY worker's pid (in the container's pid namespace, where there is one)."""
        try:
            workers = requests.get(
                f"{self.management_url}/models/llava", headers=self.management_auth(), timeout=10
            ).json()
            return next((w["pid"] for w in workers[0]["workers"] if w["status"] == "READY"), None)
        except (requests.RequestException, ValueError, LookupError):
            return None

    def invoke(self, body: dict, session_id: str | None = None, **kwargs) -> requests.Response:
        headers = {SESSION: session_id} if session_id else {}
        return requests.post(
            f"{self.url}/invocations", json=body, headers=headers, timeout=60, **kwargs
        )
