"""One forward step over many sequences packed together, on KV held in the pool.

The tokens of every sequence in the batch (a prefill tail or one decoded id each) are packed
into one [tokens, hidden] matrix with no padding, so each layer's projections and MLP run as
one batched matmul. Attention is the ``attention`` setting (EngineConfig.attention): ``flex``,
one paged flex_attention call per layer for every decode row over the pool as it lies
(llava.exec.attention: a block mask from the block tables, no gather); ``triton``, the same rows
through the project's split-K Triton kernel over the block tables (llava.exec.triton_decode);
``sdpa``, one SDPA per sequence read in place; ``auto``, sdpa on CPU (measured faster there)
and on CUDA whichever of flex and triton ``settle_attention`` timed faster at warm-up.
Prefill chunks get one SDPA each, 4-D with a lower-right causal bias (SDPA's fused kernels).
Under ``auto`` a paged call that raises (a compile, most likely; the engine's warm-up is the
first to make one) switches the runner to sdpa for good, the step is run again, and the switch
is logged once and counted; a forced ``flex`` or ``triton`` lets the error out
(PagedAttentionFailed). The step's index tensors are built once (llava.exec.step_meta) and the
next ids are chosen on the device (llava.sampling.sampler). A layer runs as two pieces around
attention over the checkpoint's own weights (QKV and gate/up merged as views of them,
llava.exec.layers), with its norms' eps and its rotary embedding
(docs/engine/execution.md §Step runner).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llava.config import ATTENTION, SettingsError
from llava.counters import Counters
from llava.exec import compiler, triton_decode
from llava.exec import graphs as decode_graphs
from llava.exec.attention import PAGED, PagedRows, attend_paged, padded_rows, paged_rows
from llava.exec.graphs import GRAPHS_BUDGET_FLOOR, DecodeGraphs, one_line
from llava.exec.layers import LayerPieces, merge_problem, merge_projections
from llava.exec.step_meta import StepBuffers, StepMeta, build_step_meta, row_slots
from llava.kv.pool import KVPool, SessionKV, kv_geometry
from llava.sampling.chooser import Chooser
from llava.sampling.params import GenerationParams
from llava.sampling.sampler import Sampler, SamplingRows

logger = logging.getLogger(__name__)


class PagedAttentionFailed(RuntimeError):
    """The paged attention call (flex or Triton) raised (a compile, most likely): ``auto``
    attention falls back to sdpa on it, a forced ``flex`` or ``triton`` lets it out."""


@dataclass(frozen=True)
class RunnerCounters(Counters):
    attention_fallbacks: int = 0  # the paged path raised under "auto": switched to sdpa
    graph_capture_failures: int = 0  # decode graph buckets whose capture raised (run eagerly)
    compile_fallbacks: int = 0  # the compiled layer pieces raised: they run eagerly
    device_out_of_memory: int = 0  # steps or vision-tower runs the device had no memory for


@dataclass(frozen=True)
class Attending:
    """What ``_attention`` needs of a step's metadata (a decode-only step's, in ``decode``)."""

    decode_rows: torch.Tensor | None
    paged: PagedRows | None
    prefills: list


# Rotary types whose frequencies do not depend on the batch: the model's rotary module gives
# each token the same angles alone or packed. "dynamic" and "longrope" rescale by the largest
# position in the forward, which a packed batch would share across sequences.
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3"})
# Text models whose decoder layers are LLaMA's (RMSNorm, rotate-half rotary, gated MLP), with
# any number of KV heads: Vicuna and Yi are "llama", Mistral is "mistral".
TEXT_MODEL_TYPES = frozenset({"llama", "mistral"})


@dataclass
class StepInput:
    kv: SessionKV
    ids: list[int]  # new ids appended after kv.length (a prefill tail, or one decoded id)
    image_features: torch.Tensor | None = None  # (image tokens in ids, hidden)
    chooser: Chooser | None = None  # how ``next_ids`` picks its next id (None: greedy)


def _layer_problem(layer) -> str | None:
    attn = getattr(layer, "self_attn", None)
    parts = ("input_layernorm", "post_attention_layernorm", "mlp")
    if attn is None or any(not hasattr(layer, part) for part in parts):
        return f"decoder layer {type(layer).__name__} is not LLaMA-like"
    if any(not hasattr(attn, proj) for proj in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return f"attention {type(attn).__name__} has no q/k/v/o projections"
    return None


class Runner:
    """``attention``: one of ATTENTION (see the module's docstring); ``self.attention`` is
    the path in effect, "flex", "triton" or "sdpa"."""

    def __init__(
        self, model, pool: KVPool, sampler: Sampler | None = None, attention: str = "auto"
    ):
        self.check(model)
        text = model.config.text_config
        layers, kv_heads, head_dim = kv_geometry(text)
        shape = pool.kv.shape
        if (shape[0], shape[2], shape[4]) != (layers, kv_heads, head_dim):
            raise ValueError(f"KV pool shape {tuple(pool.kv.shape)} does not fit the model")
        if pool.kv.dtype != model.dtype or pool.kv.device != model.device:
            raise ValueError(
                f"KV pool is {pool.kv.dtype} on {pool.kv.device}, model is {model.dtype} on "
                f"{model.device}"
            )
        self.model = model
        self.pool = pool
        self.lm = model.model.language_model
        # QKV and gate/up merged in place (views, no extra memory), and each layer's pieces
        # around attention compiled once for all layers on CUDA, where they save launches (on
        # CPU eager pieces were faster: llava.exec.layers.LayerPieces)
        self.layer_weights = merge_projections(model)
        self.pieces = LayerPieces(compile=pool.kv.device.type == "cuda")
        self.image_token_id = model.config.image_token_id
        self.heads = text.num_attention_heads
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.sampler = sampler
        self._buffers = StepBuffers(pool.kv.device)
        self._greedy = None  # the chooser of rows that bring none
        self.pool_slots = pool.kv.shape[3]
        self.max_tokens = text.max_position_embeddings  # the longest row: splits by bucket
        # "flex" / "triton": one paged call a layer for every decode row; "sdpa": one SDPA per
        # sequence over its slots in place. "auto": sdpa on CPU (measured faster there); on
        # CUDA flex until ``settle_attention`` has timed flex against triton (an H200: flex
        # 0.98 ms a layer at 32 rows against the SDPA loop's 5.6; docs/testing.md §GPU check).
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION)}, got {attention!r}")
        if attention == "triton" and (why := triton_decode.unavailable(pool.kv.device)):
            raise SettingsError("attention", f"triton: {why}")
        self.attention_setting = attention
        if attention == "auto":
            attention = "flex" if pool.kv.device.type == "cuda" else "sdpa"
        self.attention = attention  # the path in effect: "flex", "triton" or "sdpa"
        self.graphs = None  # llava.exec.graphs.DecodeGraphs, when captured (CUDA)
        self._counters = RunnerCounters()

    @classmethod
    def check(cls, model) -> None:
        """Raise ValueError saying why the runner cannot run ``model`` (engine start, capacity)."""
        problem = cls.supports(model)
        if problem:
            raise ValueError(f"the step runner cannot run this model: {problem}")

    @staticmethod
    def supports(model) -> str | None:
        """None when the runner computes exactly what this model's forward does, else why not."""
        text = model.config.text_config
        if text.model_type not in TEXT_MODEL_TYPES:
            return f"text model type {text.model_type!r} (runs: {sorted(TEXT_MODEL_TYPES)})"
        window = getattr(text, "sliding_window", None)
        if window and window < text.max_position_embeddings:  # a wider window is no window
            return f"sliding-window attention (sliding_window {window})"
        rope = getattr(text, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            return f"rope type {rope_type!r} (runs: {sorted(STATIC_ROPE_TYPES)})"
        lm = getattr(getattr(model, "model", None), "language_model", None)
        if lm is None or not hasattr(lm, "layers") or not hasattr(lm, "rotary_emb"):
            return "no LLaMA-like language model at model.model.language_model"
        for layer in lm.layers:
            problem = _layer_problem(layer)
            if problem:
                return problem
        return merge_problem(model)

    @torch.inference_mode()
    def step(self, batch: list[StepInput]) -> torch.Tensor:
        """One forward over all sequences packed together (prefills and decodes may be mixed).

        Every kv must already have reserved room for its ids. Returns float32 logits
        [len(batch), vocab] at each sequence's last new position; each kv.length grows by
        len(ids). On an error no kv.length changes.
        """
        self._check(batch)
        logits = self._eager_logits(batch)
        for item in batch:
            item.kv.length += len(item.ids)
        return logits

    @torch.inference_mode()
    def next_ids(self, batch: list[StepInput]) -> list[int]:
        """``step``, then each sequence's next id chosen on the device by its chooser (greedy
        without one); the ids are the step's one copy to the host. Decode-only batches replay
        a captured graph when one was captured for their size (llava.exec.graphs)."""
        self._check(batch)
        choosers = [item.chooser or self._greedy_chooser() for item in batch]
        ids = self.graphs.run(batch, choosers) if self.graphs is not None else None
        if ids is None:
            ids = self.sampler.sample(self._eager_logits(batch), choosers).tolist()
        for item in batch:
            item.kv.length += len(item.ids)
        return ids

    def decode(
        self, ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor, rows: SamplingRows
    ) -> torch.Tensor:
        """One decode step as a function of tensors alone (no host value, no data-dependent
        shape), so ``torch.compile(fullgraph=True)`` and CUDA graphs take it whole: row i feeds
        ``ids[i]`` at ``positions[i]`` of the sequence with pool blocks ``tables[i]``; returns
        each row's next id, on the device."""
        write_slots = row_slots(tables, positions, self.pool.block_tokens)
        attending = Attending(None, self._paged_rows(tables, positions), [])
        hidden = self.lm.embed_tokens(ids)
        logits = self._forward(hidden, positions, write_slots, attending, None)
        return self.sampler.choose(logits, rows)

    def capture_graphs(self, max_batch: int) -> DecodeGraphs | None:
        """On CUDA, capture decode graphs for the buckets up to ``max_batch`` whose memory
        fits a twentieth of the pool's bytes, at least GRAPHS_BUDGET_FLOOR (llava.exec.graphs);
        elsewhere nothing (None). A bucket whose capture raised is counted
        (``graph_capture_failures``) and runs eagerly.

        Nothing either with sdpa attention: a graph replays ``decode``, whose attention is
        always the paged call, so it would run the path that was set aside (by the setting, or
        by a fallback because the paged call failed)."""
        if self.attention not in PAGED or not decode_graphs.capturable(self.pool.kv.device):
            return None
        graphs = DecodeGraphs(self)
        graphs.capture(max_batch, max(self.pool.allocated_bytes // 20, GRAPHS_BUDGET_FLOOR))
        self._counters = self._counters.plus(graph_capture_failures=len(graphs.failed))
        self.graphs = graphs
        return graphs

    def settle_attention(self, rows: int = 32, tokens: int = 650) -> dict[str, float] | None:
        """Under ``auto`` with a paged path in effect (CUDA), time one layer's paged call of
        each path at ``rows`` rows of ``tokens`` tokens and keep the faster (a path that raises
        is not kept). Returns the milliseconds of each, logged; None when nothing was timed
        (another setting, sdpa in effect, or the Triton kernel unavailable)."""
        device = self.pool.kv.device
        if self.attention_setting != "auto" or self.attention not in PAGED:
            return None
        if triton_decode.unavailable(device):
            return None
        timings = {kind: self._time_paged(kind, rows, tokens) for kind in PAGED}
        self.attention = min(timings, key=timings.get)
        logger.info("attention auto: %s (ms a layer: %s)", self.attention, timings)
        return timings

    def _time_paged(self, kind: str, rows: int, tokens: int, repeats: int = 5) -> float:
        """Milliseconds one paged call of ``kind`` takes over the pool's first blocks (read,
        never written), inf if it raises."""
        bt, device = self.pool.block_tokens, self.pool.kv.device
        per_row = -(-tokens // bt)
        rows = max(1, min(rows, self.pool.total_blocks // per_row))
        tables = torch.zeros(rows, self.pool_slots // bt, dtype=torch.int32, device=device)
        tables[:, :per_row] = torch.arange(per_row, dtype=torch.int32, device=device)
        positions = torch.full((rows,), min(tokens, per_row * bt) - 1, device=device)
        q = torch.randn(rows, self.heads, self.head_dim, dtype=self.pool.kv.dtype, device=device)
        keys, values = self.pool.kv[0]
        scaling = self.lm.layers[0].self_attn.scaling
        try:
            paged = self._paged_rows(tables, positions, kind)
            attend_paged(q, keys, values, paged, scaling)  # compiles
            _synchronize(device)
            start = time.perf_counter()
            for _ in range(repeats):
                attend_paged(q, keys, values, paged, scaling)
            _synchronize(device)
            return (time.perf_counter() - start) / repeats * 1e3
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as e:
            logger.warning("attention auto: %s not timed: %s", kind, one_line(e))
            return math.inf

    def warm_up_layers(self) -> None:
        """Compile the layer pieces now (CUDA), so the compile, or its failure (logged once,
        counted), comes at start and not in a request."""
        if self.pieces.compiled:
            self.pieces.warm_up(self.layer_weights[0])

    def enter_thread(self) -> None:
        """Called by the thread that will run the model (the engine loop's) before it runs
        anything: torch's compiler settings are per thread (llava.exec.compiler). The layer
        pieces' compile runs in process, so that a failure shows its own error."""
        compiler.for_this_thread(in_process=self.pieces.compiled)

    def out_of_memory(self) -> None:
        """A step or the vision tower ran out of device memory (the pool is allocated once, so
        it was their activations): count it, and hand the allocator's cached blocks back so the
        retry, or the next request, starts from all that is free."""
        self._counters = self._counters.plus(device_out_of_memory=1)
        if self.pool.kv.device.type == "cuda":
            torch.cuda.empty_cache()

    def counters(self) -> RunnerCounters:
        """A snapshot: how often the runner degraded (attention fallbacks, graphs not captured,
        layer pieces run eagerly)."""
        return self._counters.plus(compile_fallbacks=self.pieces.compile_fallbacks)

    def _greedy_chooser(self) -> Chooser:
        if self._greedy is None:
            self._greedy = Chooser(GenerationParams(), frozenset())
        return self._greedy

    # -- one step's pieces -----------------------------------------------------------------
    def _eager_logits(self, batch: list[StepInput]) -> torch.Tensor:
        """The step's logits, run eagerly. Under ``auto``, a flex call that raises switches the
        runner to sdpa for good and the step runs again: nothing the failed try did counts
        (no kv.length moved; its K/V writes land in the same reserved slots again)."""
        try:
            return self._logits(batch, self._meta(batch))
        except PagedAttentionFailed as e:
            if self.attention_setting != "auto":
                raise
            self._fall_back(e)
        return self._logits(batch, self._meta(batch))

    def _fall_back(self, error: PagedAttentionFailed) -> None:
        # Graphs captured before (their paged call compiled and ran) keep replaying; none are
        # captured after (capture_graphs). At warm-up, the usual place, there are none yet.
        self.attention = "sdpa"
        self._counters = self._counters.plus(attention_fallbacks=1)
        logger.warning("attention auto: switching to sdpa for good: %s", error)

    def _check(self, batch: list[StepInput]) -> None:
        """Every input is checked before anything changes."""
        if not batch:
            raise ValueError("empty batch")
        if len({id(item.kv) for item in batch}) != len(batch):
            raise ValueError("a sequence appears twice in one step")
        for item in batch:
            kv, n = item.kv, len(item.ids)
            if kv.pool is not self.pool:
                raise ValueError("a SessionKV from another pool")
            if n == 0:
                raise ValueError("a sequence with no new ids")
            if kv.length + n > kv.capacity:
                raise ValueError(
                    f"{n} new ids after {kv.length} need {kv.length + n} reserved tokens, "
                    f"{kv.capacity} are: reserve first"
                )

    def _meta(self, batch: list[StepInput]) -> StepMeta:
        return build_step_meta(
            self._buffers,
            [i for item in batch for i in item.ids],
            [item.kv.length for item in batch],
            [len(item.ids) for item in batch],
            [item.kv.blocks for item in batch],
            self.pool.block_tokens,
            self.pool_slots // self.pool.block_tokens,
            self._paged_rows if self.attention in PAGED else None,
        )

    def _paged_rows(
        self, tables: torch.Tensor, positions: torch.Tensor, kind: str | None = None
    ) -> PagedRows:
        """The rows for the paged path ``kind`` (None: the one in effect); splits by their
        bucket, so each bucket compiles once."""
        bt = self.pool.block_tokens
        rows = padded_rows(tables.shape[0])
        splits = triton_decode.default_splits(rows, self.kv_heads, self.max_tokens, bt)
        kind = kind or self.attention
        return paged_rows(kind, tables, positions, bt, self.pool_slots, splits)

    def _logits(self, batch: list[StepInput], meta: StepMeta) -> torch.Tensor:
        hidden = self._embed(batch, meta)
        return self._forward(hidden, meta.positions, meta.write_slots, meta, meta.last)

    def _forward(self, hidden, positions, write_slots, attending, last) -> torch.Tensor:
        """The layers over packed tokens; float32 logits at the ``last`` rows (all if None).
        ``attending``: which rows are decode rows (their paged inputs) and which prefills."""
        cos, sin = self.lm.rotary_emb(hidden, positions[None])
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]  # [T, 1, head_dim]: broadcast on heads
        delta = None  # a layer's MLP output: the next layer's first piece adds it
        layers = zip(self.lm.layers, self.layer_weights, strict=True)
        for index, (layer, weights) in enumerate(layers):
            q, k, v, hidden = self.pieces.pre(hidden, delta, weights, cos, sin)
            out = self._attention(index, layer.self_attn.scaling, q, k, v, write_slots, attending)
            hidden, delta = self.pieces.post(out.reshape(q.shape[0], -1), hidden, weights)
        if last is not None:
            hidden, delta = hidden[last], delta[last]
        return self.model.lm_head(self.lm.norm(hidden + delta)).float()

    def _embed(self, batch: list[StepInput], meta: StepMeta) -> torch.Tensor:
        """Token embeddings, image features in the image-token positions (found on the host:
        no device sync per sequence)."""
        where, features, start = [], [], 0
        for item in batch:
            image_at = [
                start + i for i, token in enumerate(item.ids) if token == self.image_token_id
            ]
            rows = 0 if item.image_features is None else item.image_features.shape[0]
            if rows != len(image_at):
                raise ValueError(
                    f"{len(image_at)} image tokens in the new ids but {rows} image feature rows"
                )
            if rows:
                where.extend(image_at)
                features.append(item.image_features)
            start += len(item.ids)
        hidden = self.lm.embed_tokens(meta.ids)
        if where:
            rows = torch.cat(features).to(hidden.device, hidden.dtype)
            hidden[torch.tensor(where, device=hidden.device)] = rows
        return hidden

    def _attention(self, index: int, scale: float, q, k, v, write_slots, attending):
        """Layer ``index``'s K/V written to the pool, then attention: [T, heads, head_dim]."""
        keys, values = self.pool.kv[index]  # [kv_heads, slots, head_dim] each
        keys.index_copy_(1, write_slots, k.transpose(0, 1))
        values.index_copy_(1, write_slots, v.transpose(0, 1))
        gqa = self.heads != self.kv_heads
        rows = attending.decode_rows
        if rows is None and not attending.prefills:  # a decode-only step
            out = _paged(q, keys, values, attending.paged, scale)
        else:
            out = torch.empty_like(q)
            if attending.paged is not None:
                out[rows] = _paged(q[rows], keys, values, attending.paged, scale)
            for prefill in attending.prefills:  # prefills are compute-bound: one SDPA each
                start, stop = prefill.span
                # 4-D, the causal bias or no mask: what SDPA's fused kernels take
                out[start:stop] = F.scaled_dot_product_attention(
                    q[start:stop].transpose(0, 1)[None],
                    _read(keys, prefill.slots)[None],
                    _read(values, prefill.slots)[None],
                    attn_mask=prefill.causal,
                    scale=scale,
                    enable_gqa=gqa,
                )[0].transpose(0, 1)
        return out


def _paged(q, keys, values, rows: PagedRows, scale) -> torch.Tensor:
    """``attend_paged``; whatever it raises but running out of memory (which the caller
    handles as such) comes out as PagedAttentionFailed, so the runner knows the path failed."""
    try:
        return attend_paged(q, keys, values, rows, scale)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as e:
        raise PagedAttentionFailed(f"paged {rows.kind} attention failed: {one_line(e)}") from e


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _read(kv: torch.Tensor, slots) -> torch.Tensor:
    """``kv[:, slots]`` of a sequence's slots (llava.exec.step_meta.Prefill.slots)."""
    if isinstance(slots, tuple):
        return torch.cat([kv[:, run] for run in slots], dim=1)
    return kv[:, slots]
