"""Keep one TorchServe instance serving: restart the whole instance when its READY worker dies.

Why the whole instance: in TorchServe 0.12 async mode a restarted worker never becomes READY on
the management API, a request that reaches it while it reloads crash-loops it ("Received more
than 1 control command"), and scaling the model 0 -> 1 races with the dead worker's own
scheduled retry (docs/serving.md §Worker restarts). The worker's sessions are in the persistent
tier (docs/engine/sessions.md §Persistent tier), which the fresh TorchServe's worker adopts; the
fresh instance carries no stale Java state.

``ready()`` is what fronts ask before forwarding anything: True only while the worker that
``start`` (or a restart) saw READY is alive, so nothing is sent to a reloading instance. Java
itself exiting is not a worker death: the instance is gone (``watch`` raises), as before.
Restarts are bounded: more than ``max_restarts`` within ``window_s`` → ``RestartLimit``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from serving.torchserve import TorchServeError, TorchServeInstance, alive

POLL_S = 0.05  # how soon a dead worker is noticed (a psutil status read: cheap)


class RestartLimit(TorchServeError):
    """The worker died too often: give up, so that whoever runs us replaces the machine."""


class Supervisor:
    def __init__(
        self,
        ts: TorchServeInstance,
        max_restarts: int = 3,
        window_s: float = 600.0,
        start_timeout_s: float = 180.0,
        log: Callable[[str], None] = print,
    ):
        self.ts = ts
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.start_timeout_s = start_timeout_s
        self.log = log
        # what a worker's death tells whoever routes to it (the local endpoint's router)
        self.on_death: Callable[[], None] = lambda: None
        self.restarts: deque[float] = deque()  # monotonic times of the restarts in the window
        self._pid: int | None = None  # the READY worker we watch; None while (re)starting
        self.gave_up = False  # watch_in_thread ended: the instance is left down

    def ready(self) -> bool:
        pid = self._pid
        return pid is not None and alive(pid)

    def start(self) -> int:
        """Start the instance and wait for its READY worker; return the worker's pid."""
        self._pid = self.ts.start(self.start_timeout_s)
        return self._pid

    def adopt(self) -> int:
        """Watch an instance that someone else started and that is READY now."""
        if (pid := self.ts.worker_pid()) is None:
            raise TorchServeError(f"no READY worker to watch in {self.ts.root}")
        self._pid = pid
        return pid

    def watch(self, stop: threading.Event) -> None:
        """Until ``stop`` is set: restart the instance whenever the READY worker dies.

        Raises ``TorchServeError`` when Java exits by itself or a restart fails to start, and
        ``RestartLimit`` when the restarts exceed the bound; ``ready()`` is False from then on.
        """
        while not stop.wait(POLL_S):
            if self.ts.java_pid() is None:
                self._pid = None
                raise TorchServeError(f"TorchServe exited ({self.ts.root})")
            if not self.ready():
                self.restart()

    def watch_in_thread(self, stop: threading.Event) -> threading.Thread:
        """``watch`` in a daemon thread; how it ended goes to the log (``ready()`` stays False)."""

        def run() -> None:
            try:
                self.watch(stop)
            except TorchServeError as e:
                self.gave_up = True
                self.log(f"supervisor: {str(e).splitlines()[0]}; instance left down")

        thread = threading.Thread(target=run, name=f"supervise {self.ts.root.name}", daemon=True)
        thread.start()
        return thread

    def restart(self) -> int:
        dead, self._pid = self._pid, None
        self.on_death()
        now = time.monotonic()
        while self.restarts and now - self.restarts[0] > self.window_s:
            self.restarts.popleft()
        if len(self.restarts) >= self.max_restarts:
            raise RestartLimit(
                f"worker {dead} died: {len(self.restarts) + 1} worker deaths within "
                f"{self.window_s:.0f} s (limit {self.max_restarts} restarts), giving up"
            )
        self.restarts.append(now)
        self.log(f"supervisor: worker {dead} died, restarting TorchServe ({self.ts.root})")
        began = time.monotonic()
        self.ts.stop(graceful=False)  # nothing to save: the sessions are in the persistent tier
        pid = self.start()
        self.log(f"supervisor: READY again in {time.monotonic() - began:.1f} s: worker pid {pid}")
        return pid
