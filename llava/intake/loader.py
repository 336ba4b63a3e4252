"""Images fetched and decoded on a few threads of their own, apart from the request threads.

A 16-megapixel decode holds its thread for a second or more; on the request threads a burst of
them would hold every thread a worker serves with. Here they queue for ``workers`` threads
instead, and a request waits for a thread and its fetch together at most ``intake.deadline_s``.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor, wait

from PIL import Image

from llava.errors import ImageFetchFailed

from . import load_image
from .limits import Deadline
from .policy import IntakePolicy


class ImageLoader:
    """``load_image`` on a pool of ``workers`` threads, bounded by the policy's deadline."""

    def __init__(self, policy: IntakePolicy, workers: int):
        self.policy = policy
        self.workers = workers
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="image")

    def load(self, source: object, fit: int | None = None) -> Image.Image:
        """The RGB image ``source`` names (``load_image``), or ``ImageFetchFailed`` once
        ``intake.deadline_s`` has passed, the wait for a free thread included."""
        deadline = Deadline(self.policy.deadline_s)
        job = self._pool.submit(self._load, source, fit, deadline)
        done, _ = wait([job], timeout=deadline.remaining())
        if not done:
            raise self._late(job)
        return job.result()

    def _load(self, source: object, fit: int | None, deadline: Deadline) -> Image.Image:
        remaining = deadline.remaining()
        if remaining <= 0:  # its caller stopped waiting just as the thread came free
            raise self._waited()
        # The fetch ends when its caller stops waiting: no thread fetches for nobody.
        return load_image(source, dataclasses.replace(self.policy, deadline_s=remaining), fit)

    def _late(self, job: Future) -> ImageFetchFailed:
        if job.cancel():  # still queued: it will never run
            return self._waited()
        return ImageFetchFailed(
            f"fetching and decoding the image took longer than {self.policy.deadline_s:g} s; "
            f"send a smaller image or raise intake.deadline_s"
        )

    def _waited(self) -> ImageFetchFailed:
        return ImageFetchFailed(
            f"no image thread came free within {self.policy.deadline_s:g} s (all "
            f"{self.workers} busy with other images); retry later, or raise image_workers"
        )
