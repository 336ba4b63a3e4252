"""The engine: open a session on an image, ask questions on top of its KV cache, close it.

``Engine`` is the one object a transport (the TorchServe handler, a notebook, a test) uses.
Its methods are thread-safe and blocking: many threads may call them at once. Inputs are
checked and images preprocessed in the caller's thread; the model work is queued to one
engine-loop thread (llava.loop) that batches the turns of different sessions into each step.
It raises only ``llava.errors`` types, so a transport can map every failure to a status.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable

import torch
from PIL import Image

from llava.config import EngineConfig
from llava.errors import InvalidRequest
from llava.generation import GenerationParams
from llava.imageprep import prepare_image
from llava.kv_pool import KVPool
from llava.logits_mask import banned_token_ids
from llava.loop import EngineLoop
from llava.model import LoadedModel, load_model
from llava.runner import Runner, StepInput
from llava.sampling import Sampler
from llava.scheduler import Scheduler
from llava.store import SessionStore, StoreStats
from llava.work import Answer, Opened, OpenRequest, TurnRequest

__all__ = ["Answer", "Engine", "Opened"]


class Engine:
    """``max_batch``: sequences per step (1 = one request at a time). The KV pool holds
    ``kv_pool_bytes`` (default: the store's budget), allocated once here."""

    def __init__(
        self,
        loaded: LoadedModel,
        store: SessionStore,
        config: EngineConfig,
        *,
        max_batch: int = 32,
        prefill_chunk_tokens: int = 512,
        mixed_steps: bool = True,
        kv_pool_bytes: int | None = None,
    ):
        self.loaded = loaded
        self.store = store
        self.config = config
        self.device = loaded.device
        self.image_token_id = loaded.model.config.image_token_id
        self._banned_ids = banned_token_ids(
            loaded.tokenizer, loaded.model.config.text_config.vocab_size, loaded.eos_token_ids
        )
        self.pool = KVPool(
            loaded.model.config.text_config,
            kv_pool_bytes or store.budget_bytes,
            loaded.device,
            loaded.dtype,
        )
        vocab = loaded.model.config.text_config.vocab_size
        sampler = Sampler(vocab, self._banned_ids, loaded.eos_token_ids, loaded.device)
        self.runner = Runner(loaded.model, self.pool, sampler)
        scheduler = Scheduler(max_batch, prefill_chunk_tokens, mixed_steps)
        self.loop = EngineLoop(self.runner, scheduler, time.monotonic).start()
        weakref.finalize(self, self.loop.stop)  # the loop thread ends with its engine

    @classmethod
    def from_config(cls, config: EngineConfig, **options) -> Engine:
        loaded = load_model(
            config.model_dir, config.device, config.dtype, config.attn_implementation
        )
        store = SessionStore(
            budget_bytes=_session_budget(config, loaded), ttl_s=config.session_ttl_s
        )
        return cls(loaded, store, config, **options)

    def warm_up(self) -> float:
        """Run the vision tower, a prefill and a decode step once, outside any session, so the
        first caller does not pay for lazy initialization. Returns the seconds it took."""
        start = time.perf_counter()
        size = self.loaded.processor.image_processor.crop_size
        pixels = self._pixels(Image.new("RGB", (size["width"], size["height"])))
        self.loop.call(lambda: self._warm_up(pixels))
        return time.perf_counter() - start

    def _warm_up(self, pixels: torch.Tensor) -> None:
        features = self._image_features(pixels)
        ids = self.loaded.prompt.opening_ids(True, image_tokens=features.shape[0])
        kv = self.pool.new_kv()
        try:
            self.store.reserve(kv, len(ids) + 1)
            self.runner.step([StepInput(kv, ids, features)])
            self.runner.step([StepInput(kv, ids[:1], None)])  # ids[0]: not an image token
        finally:
            self.store.release(kv)
        self.runner.capture_graphs(self.loop.scheduler.max_batch)  # CUDA only

    # -- the three operations --------------------------------------------------------------
    def open(self, image: Image.Image | None = None, session_id: str | None = None) -> Opened:
        """Run the vision tower once and prefill the opening; the session starts hot.

        ``session_id``: the caller's own id for the session (checked before any model work);
        by default the server picks an unguessable one.
        """
        if session_id is not None:
            self.store.check_id_free(session_id)
        pixels = None if image is None else self._pixels(image)
        return self.loop.submit(OpenRequest(self, pixels, session_id))

    def ask(
        self,
        session_id: str,
        question: str,
        parameters: dict | None = None,
        on_token: Callable[[str, int | None], None] | None = None,
        *,
        cancelled: Callable[[], bool] | None = None,
    ) -> Answer:
        """Answer ``question`` in the session; turns of one session run in arrival order.

        ``on_token(text, token_id)`` is called from the loop thread for every generated id as
        it is generated, with the text it adds (empty for special ids or a partial character);
        a last call with ``token_id=None`` carries any text held back. The texts concatenate to
        the answer. ``cancelled()`` is polled before every step: when true the turn ends there
        (stop_reason "cancelled"); past ``turn_deadline_s`` it ends too ("deadline"). Either
        way the turn is committed like one cut by max_new_tokens.
        """
        params = GenerationParams.from_mapping(
            parameters,
            default_max_new_tokens=self.config.default_max_new_tokens,
            max_new_tokens_limit=self.config.max_new_tokens_limit,
        )
        question = self._check_question(question)
        request = TurnRequest(self, session_id, question, params, on_token, cancelled)
        return self.loop.submit(request)

    def close(self, session_id: str) -> str | None:
        """None if this closed it; else why it was already gone (see SessionStore.close)."""
        return self.store.close(session_id)

    def stats(self) -> StoreStats:
        return self.store.stats()

    def stop(self) -> None:
        """End the loop thread (what it still runs or holds fails); for a clean exit."""
        self.loop.stop(wait=True)

    # -- helpers ---------------------------------------------------------------------------
    def _pixels(self, image: Image.Image) -> torch.Tensor:
        """The processor's preprocessing: runs in the caller's thread, off the loop."""
        image_processor = self.loaded.processor.image_processor
        image = prepare_image(image, self.loaded.image_aspect_ratio, image_processor)
        return image_processor(images=image, return_tensors="pt").pixel_values

    @torch.inference_mode()
    def _image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The vision tower + projector, once per session: (image tokens, hidden) features."""
        model = self.loaded.model
        pixels = pixel_values.to(self.loaded.device, self.loaded.dtype)
        pooled = model.get_image_features(pixel_values=pixels, return_dict=True).pooler_output
        if isinstance(pooled, list | tuple):
            pooled = torch.cat(list(pooled), dim=0)
        return pooled.reshape(-1, pooled.shape[-1])

    def _check_question(self, question) -> str:
        if not isinstance(question, str) or not question.strip():
            raise InvalidRequest("'inputs' must be a non-empty question string")
        if len(question) > self.config.max_question_chars:
            raise InvalidRequest(
                f"the question has {len(question)} characters; the limit is "
                f"{self.config.max_question_chars}"
            )
        return question.strip()

    def check_length(self, needed: int) -> None:
        if needed > self.loaded.max_positions:
            raise InvalidRequest(
                f"the conversation would reach {needed} tokens, past the model's "
                f"{self.loaded.max_positions}; lower max_new_tokens or open a new session",
                code="CONVERSATION_TOO_LONG",
            )


def _session_budget(config: EngineConfig, loaded: LoadedModel) -> int:
    if config.session_budget_bytes is not None:
        return config.session_budget_bytes
    if loaded.device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(loaded.device)
        return int(free * config.session_budget_fraction)
    return config.cpu_session_budget_bytes
