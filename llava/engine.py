"""The engine: open a session on an image, ask questions on top of its KV cache, close it.

``Engine`` is the one object a transport (the TorchServe handler, a notebook, a test) uses.
It owns the loaded model and the SessionStore; it validates its inputs and raises only
``llava.errors`` types, so a transport can map every failure to a status.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

import torch
from PIL import Image
from transformers import DynamicCache

from llava.config import EngineConfig
from llava.decoding import decode, prefill
from llava.errors import InvalidRequest
from llava.generation import GenerationParams
from llava.model import LoadedModel, load_model
from llava.session import Session, Tier
from llava.store import SessionStore, StoreStats, new_session_id
from llava.streaming import TextDeltas


@dataclass(frozen=True)
class Opened:
    session_id: str
    expires_at: datetime
    prefill_tokens: int
    image_tokens: int


@dataclass(frozen=True)
class Answer:
    session_id: str
    text: str
    token_ids: tuple[int, ...]
    finished: bool  # False: cut off by max_new_tokens
    new_tokens: int  # prefilled this turn
    cached_tokens: int  # reused from the session's KV cache
    tier: Tier  # the session's tier when the turn started
    ttft_s: float
    total_s: float
    expires_at: datetime


class Engine:
    def __init__(self, loaded: LoadedModel, store: SessionStore, config: EngineConfig):
        self.loaded = loaded
        self.store = store
        self.config = config

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        loaded = load_model(
            config.model_dir, config.device, config.dtype, config.attn_implementation
        )
        store = SessionStore(
            budget_bytes=_session_budget(config, loaded), ttl_s=config.session_ttl_s
        )
        return cls(loaded, store, config)

    def warm_up(self) -> float:
        """Run the vision tower, a prefill and a decode step once, outside any session, so the
        first caller does not pay for lazy initialization. Returns the seconds it took."""
        start = time.perf_counter()
        size = self.loaded.processor.image_processor.crop_size
        blank = Image.new("RGB", (size["width"], size["height"]))
        ids, features = self._encode_opening(self.loaded.prompt.opening(with_image=True), blank)
        cache = DynamicCache()
        prefill(self.loaded.model, ids, cache, features)
        prefill(self.loaded.model, ids[-1:], cache)
        return time.perf_counter() - start

    # -- the three operations --------------------------------------------------------------
    def open(self, image: Image.Image | None = None, session_id: str | None = None) -> Opened:
        """Run the vision tower once and prefill the opening; the session starts hot.

        ``session_id``: the caller's own id for the session (checked before any model work);
        by default the server picks an unguessable one.
        """
        if session_id is not None:
            self.store.check_id_free(session_id)
        opening = self.loaded.prompt.opening(with_image=image is not None)
        ids, features = self._encode_opening(opening, image)
        cache = DynamicCache()
        if ids:
            prefill(self.loaded.model, ids, cache, features)
        session = Session(session_id or new_session_id(), ids, features, cache, last_used=0.0)
        self.store.add(session)
        return Opened(
            session_id=session.session_id,
            expires_at=self.store.expires_at(session),
            prefill_tokens=len(ids),
            image_tokens=0 if features is None else features.shape[0],
        )

    def ask(
        self,
        session_id: str,
        question: str,
        parameters: dict | None = None,
        on_token: Callable[[str, int | None], None] | None = None,
    ) -> Answer:
        """Answer ``question`` in the session.

        ``on_token(text, token_id)`` is called for every generated id as it is generated, with
        the text it adds (empty for special ids or a partial character); a last call with
        ``token_id=None`` carries any text held back. The texts concatenate to the answer.
        """
        params = GenerationParams.from_mapping(
            parameters,
            default_max_new_tokens=self.config.default_max_new_tokens,
            max_new_tokens_limit=self.config.max_new_tokens_limit,
        )
        question = self._check_question(question)
        with self.store.use(session_id) as session:
            tier, cached = session.tier, session.cached_tokens
            history = session.token_ids + self._turn_ids(session, question)
            self._check_length(len(history) + params.max_new_tokens)
            deltas = TextDeltas(self.loaded.tokenizer)
            stream = None if on_token is None else lambda t: on_token(deltas.push(t), t)
            if session.cache is None:
                session.cache = DynamicCache()
            try:
                decoded = decode(
                    self.loaded.model,
                    history,
                    session.cache,
                    session.image_features,
                    params,
                    self.loaded.eos_token_ids,
                    stream,
                )
            except BaseException:
                session.demote()  # the cache may hold a partial turn; the history does not
                raise
            held_back = deltas.flush()
            if on_token is not None and held_back:
                on_token(held_back, None)
            session.token_ids = history + list(decoded.token_ids) + self._closing(decoded)
            session.turns += 1
        self.store.record_turn(decoded.prefill_tokens, cached)
        return Answer(
            session_id=session_id,
            text=self.loaded.tokenizer.decode(decoded.token_ids, skip_special_tokens=True),
            token_ids=decoded.token_ids,
            finished=decoded.finished,
            new_tokens=decoded.prefill_tokens,
            cached_tokens=cached,
            tier=tier,
            ttft_s=decoded.prefill_s,
            total_s=decoded.total_s,
            expires_at=self.store.expires_at(session),  # leaving the turn restarted the idle clock
        )

    def close(self, session_id: str) -> str | None:
        """None if this closed it; else why it was already gone (see SessionStore.close)."""
        return self.store.close(session_id)

    def stats(self) -> StoreStats:
        return self.store.stats()

    # -- helpers ---------------------------------------------------------------------------
    def _encode_opening(
        self, opening: str, image: Image.Image | None
    ) -> tuple[list[int], torch.Tensor | None]:
        if image is None:
            return self.loaded.tokenizer(opening).input_ids, None
        inputs = self.loaded.processor(text=opening, images=image, return_tensors="pt")
        return inputs.input_ids[0].tolist(), self._image_features(inputs.pixel_values)

    @torch.inference_mode()
    def _image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The vision tower + projector, once per session: (image tokens, hidden) features."""
        model = self.loaded.model
        pixels = pixel_values.to(self.loaded.device, self.loaded.dtype)
        pooled = model.get_image_features(pixel_values=pixels, return_dict=True).pooler_output
        if isinstance(pooled, list | tuple):
            pooled = torch.cat(list(pooled), dim=0)
        return pooled.reshape(-1, pooled.shape[-1])

    def _turn_ids(self, session: Session, question: str) -> list[int]:
        prompt = self.loaded.prompt
        if session.turns:
            text = prompt.follow_up(question)
        else:
            text = prompt.first_question(question, with_image=session.image_features is not None)
        return self.loaded.tokenizer(text, add_special_tokens=False).input_ids

    def _closing(self, decoded) -> list[int]:
        """An answer cut off by max_new_tokens still ends its turn with an eos id."""
        if decoded.finished:
            return []
        eos = self.loaded.tokenizer.eos_token_id
        return [eos if eos in self.loaded.eos_token_ids else min(self.loaded.eos_token_ids)]

    def _check_question(self, question) -> str:
        if not isinstance(question, str) or not question.strip():
            raise InvalidRequest("'inputs' must be a non-empty question string")
        if len(question) > self.config.max_question_chars:
            raise InvalidRequest(
                f"the question has {len(question)} characters; the limit is "
                f"{self.config.max_question_chars}"
            )
        return question.strip()

    def _check_length(self, needed: int) -> None:
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
