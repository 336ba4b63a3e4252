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
from llava.decoding import Decoded, decode, prefill
from llava.detokenizer import Detokenizer
from llava.errors import InvalidRequest
from llava.generation import GenerationParams
from llava.logits_mask import banned_token_ids
from llava.model import LoadedModel, load_model
from llava.prompt import assistant_message, common_prefix_length, user_message
from llava.session import Session, Tier
from llava.store import SessionStore, StoreStats, new_session_id


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
        self._banned_ids = banned_token_ids(
            loaded.tokenizer, loaded.model.config.text_config.vocab_size, loaded.eos_token_ids
        )

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
        ids, features = self._encode_opening(blank)
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
        ids, features = self._encode_opening(image)
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
        *,
        cancelled: Callable[[], bool] | None = None,
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
            tier = session.tier
            first_has_image = not session.messages and session.image_features is not None
            messages = [*session.messages, user_message(question, first_has_image)]
            prompt = self._prompt_ids(session, messages)
            self._check_length(len(prompt) + params.max_new_tokens)
            try:  # a turn is atomic: the session commits below, or it is demoted here
                cached = self._reuse_cache(session, prompt)
                detokenizer = Detokenizer(self.loaded.tokenizer)

                def stream(token_id: int) -> None:
                    text = detokenizer.push(token_id)
                    if on_token is not None:
                        on_token(text, token_id)

                decoded = decode(
                    self.loaded.model,
                    prompt,
                    session.cache,
                    session.image_features,
                    params,
                    self.loaded.eos_token_ids,
                    stream,
                    self._banned_ids,
                    cancelled,
                )
                held_back = detokenizer.flush()
                if on_token is not None and held_back:
                    on_token(held_back, None)
            except BaseException:
                session.demote()  # the cache may hold a partial turn; history and messages do not
                raise
            text = detokenizer.text
            session.token_ids = prompt + _answer_ids(decoded)
            session.messages = [*messages, assistant_message(text)]
            session.turns += 1
        self.store.record_turn(decoded.prefill_tokens, cached)
        return Answer(
            session_id=session_id,
            text=text,
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
    def _encode_opening(self, image: Image.Image | None) -> tuple[list[int], torch.Tensor | None]:
        """The opening's ids (image tokens expanded) and the image features, if any."""
        if image is None:
            return self.loaded.prompt.opening_ids(with_image=False), None
        pixels = self.loaded.processor.image_processor(images=image, return_tensors="pt")
        features = self._image_features(pixels.pixel_values)
        return self.loaded.prompt.opening_ids(True, image_tokens=features.shape[0]), features

    @torch.inference_mode()
    def _image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The vision tower + projector, once per session: (image tokens, hidden) features."""
        model = self.loaded.model
        pixels = pixel_values.to(self.loaded.device, self.loaded.dtype)
        pooled = model.get_image_features(pixel_values=pixels, return_dict=True).pooler_output
        if isinstance(pooled, list | tuple):
            pooled = torch.cat(list(pooled), dim=0)
        return pooled.reshape(-1, pooled.shape[-1])

    def _prompt_ids(self, session: Session, messages: list[dict]) -> list[int]:
        features = session.image_features
        image_tokens = 0 if features is None else features.shape[0]
        return self.loaded.prompt.ids(messages, image_tokens)

    @staticmethod
    def _reuse_cache(session: Session, prompt: list[int]) -> int:
        """Crop the session's cache to the longest prefix it shares with ``prompt``; return it.

        Usually that is everything cached (the prompt only appends). It is less where the
        tokenizer merges across the old boundary, e.g. an answer whose text re-tokenizes
        differently inside the next prompt (docs/design.md §Canonical prompt): the prompt is the
        checkpoint's canonical tokenization, so the differing tail is prefilled again.
        """
        if session.cache is None:
            session.cache = DynamicCache()
        held = session.token_ids[: session.cache.get_seq_length()]
        # at least one id is prefilled: its logits start the answer
        reused = min(common_prefix_length(prompt, held), len(prompt) - 1)
        if reused < len(held):  # transformers 5 crops by a negative count of ids to drop
            session.cache.crop(reused - len(held))
        return reused

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


def _answer_ids(decoded: Decoded) -> list[int]:
    """The answer as the session's history keeps it: the generated ids without the end token.

    Neither the llava-hf chat template nor the demo model's renders ``</s>`` after an assistant
    message (they render ``answer + ' '``), so the canonical next prompt holds no end token
    there; keeping one would make every follow-up diverge from what the checkpoint sees. An
    answer cut off by max_new_tokens is kept as generated, with nothing appended either.
    """
    ids = list(decoded.token_ids)
    return ids[:-1] if decoded.finished else ids
