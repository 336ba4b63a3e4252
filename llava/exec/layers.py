"""A decoder layer in fewer kernels: merged projections and two pure pieces compiled once.

``merge_projections`` lays each layer's q/k/v weights (and gate/up) end to end in one tensor at
load and makes the modules' parameters views of it, so one GEMM does the work of three (or two)
with no extra memory, and the checkpoint's parameter names and the model's own forward stay as
they were. It returns each layer's tensors as a ``LayerWeights``.

A layer is then ``pre_attention`` (residual add, RMSNorm, QKV, rotary), the KV write and
attention (the runner's, left outside), and ``post_attention`` (o_proj, residual add, RMSNorm,
gate/up, SiLU·mul, down). The weights are arguments, not module attributes, so one compiled
graph serves every layer (dynamo would guard on each module and compile 32 times).
``LayerPieces`` holds the pieces, compiled or not; a compile that raises leaves them eager
for good, logged once and counted (docs/engine/execution.md §Step runner).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

from llava.exec.graphs import one_line

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class LayerWeights:
    """One decoder layer's tensors, detached views of the model's own storage (a checkpoint
    loaded into the model later shows here). ``qkv`` is [q + k + v rows, hidden], ``gate_up``
    [2 × intermediate, hidden]; a bias is None where the checkpoint has none."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    eps: float
    heads: int
    kv_heads: int
    head_dim: int


# -- merging at load -----------------------------------------------------------------------
QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")


@torch.no_grad()
def merge_projections(model) -> list[LayerWeights] | None:
    """Merge every decoder layer's q/k/v and gate/up projections of ``model`` (a LLaVA whose
    text model is at ``model.model.language_model``; Runner.supports says it is LLaMA's
    maths) and return each layer's ``LayerWeights``; None, with nothing changed, when
    ``merge_problem`` names one.

    Idempotent: projections already lying end to end are viewed, not copied. Merge once the
    model is on its device and in its dtype: moving it copies each parameter apart again."""
    if merge_problem(model) is not None:
        return None
    return [_merge_layer(layer) for layer in model.model.language_model.layers]


def merge_problem(model) -> str | None:
    """None when ``merge_projections`` can merge every layer of ``model``, else why not."""
    activation = model.config.text_config.hidden_act
    if activation != "silu":
        return f"activation {activation!r} (the merged MLP is SiLU's)"
    for index, layer in enumerate(model.model.language_model.layers):
        problem = _layer_problem(layer)
        if problem:
            return f"decoder layer {index}: {problem}"
    return None


def _layer_problem(layer) -> str | None:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = [getattr(layer, name, None) for name in ("input_layernorm", "post_attention_layernorm")]
    if any(not hasattr(norm, "variance_epsilon") for norm in norms):
        return "no RMSNorm before attention and MLP"
    if norms[0].variance_epsilon != norms[1].variance_epsilon:
        return "its two norms have different eps"
    if not hasattr(attn, "head_dim"):
        return "attention without head_dim"
    groups = [[getattr(attn, n, None) for n in QKV], [getattr(mlp, n, None) for n in GATE_UP]]
    singles = [getattr(attn, "o_proj", None), getattr(mlp, "down_proj", None)]
    if any(not isinstance(m, nn.Linear) for m in [*groups[0], *groups[1], *singles]):
        return "q/k/v/o or gate/up/down projections that are not nn.Linear"
    if any(len({m.bias is None for m in group}) > 1 for group in groups):
        return "some of q/k/v or of gate/up with a bias and some without"
    return None


def _merge_layer(layer) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    qkv = [getattr(attn, name) for name in QKV]
    gate_up = [getattr(mlp, name) for name in GATE_UP]
    return LayerWeights(
        input_norm=layer.input_layernorm.weight.detach(),
        qkv=_merged(qkv, "weight"),
        qkv_bias=_merged(qkv, "bias"),
        o=attn.o_proj.weight.detach(),
        o_bias=_detached(attn.o_proj.bias),
        post_norm=layer.post_attention_layernorm.weight.detach(),
        gate_up=_merged(gate_up, "weight"),
        gate_up_bias=_merged(gate_up, "bias"),
        down=mlp.down_proj.weight.detach(),
        down_bias=_detached(mlp.down_proj.bias),
        eps=layer.input_layernorm.variance_epsilon,
        heads=attn.q_proj.out_features // attn.head_dim,
        kv_heads=attn.k_proj.out_features // attn.head_dim,
        head_dim=attn.head_dim,
    )


def _merged(modules: Sequence[nn.Linear], name: str) -> torch.Tensor | None:
    """The modules' ``name`` tensors end to end in one tensor, each module's parameter now a
    view of its rows. The originals are freed as this returns: the merge holds at most one
    group's copy at a time."""
    tensors = [getattr(module, name) for module in modules]
    if tensors[0] is None:
        return None
    merged = _end_to_end(tensors)
    if merged is not None:
        return merged
    merged = torch.cat([t.detach() for t in tensors])
    start = 0
    for module, tensor in zip(modules, tensors, strict=True):
        rows = merged[start : start + tensor.shape[0]]
        setattr(module, name, nn.Parameter(rows, requires_grad=tensor.requires_grad))
        start += tensor.shape[0]
    return merged


def _end_to_end(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A view spanning ``tensors`` when they already lie end to end in one storage (an earlier
    merge), else None."""
    first = tensors[0]
    offset = first.storage_offset()
    for t in tensors:
        same_storage = t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        if not (same_storage and t.is_contiguous() and t.storage_offset() == offset):
            return None
        if t.dtype != first.dtype or t.shape[1:] != first.shape[1:]:
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    return first.detach().as_strided(
        (rows, *first.shape[1:]), first.stride(), first.storage_offset()
    )


def _detached(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach()


# -- the two pieces ------------------------------------------------------------------------
def pre_attention(
    hidden: torch.Tensor,
    delta: torch.Tensor | None,
    weights: LayerWeights,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer up to attention over packed tokens: ``hidden`` [T, hidden] plus ``delta`` (the
    previous layer's MLP output; None at the first layer), RMSNorm, the merged QKV GEMM, rotary
    (``cos``/``sin`` [T, 1, head_dim], broadcast on heads). Returns q [T, heads, head_dim],
    k and v [T, kv_heads, head_dim], and the residual stream after the add."""
    if delta is not None:
        hidden = hidden + delta
    x = rms_norm(hidden, weights.input_norm, weights.eps)
    qkv = F.linear(x, weights.qkv, weights.qkv_bias)
    q_size, kv_size = weights.heads * weights.head_dim, weights.kv_heads * weights.head_dim
    q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
    tokens = hidden.shape[0]
    q = rotate(q.view(tokens, weights.heads, weights.head_dim), cos, sin)
    k = rotate(k.view(tokens, weights.kv_heads, weights.head_dim), cos, sin)
    return q, k, v.view(tokens, weights.kv_heads, weights.head_dim), hidden


def post_attention(
    attn: torch.Tensor, hidden: torch.Tensor, weights: LayerWeights
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer after attention: o_proj of ``attn`` [T, heads × head_dim] added to ``hidden``,
    RMSNorm, the merged gate/up GEMM, SiLU·mul, down. Returns the residual stream after the
    add and the MLP's output, which the next layer's ``pre_attention`` (or the caller, after
    the last layer) adds: ``hidden + o(attn)``, then ``+ mlp(norm(hidden))``, as LLaMA's layer."""
    hidden = hidden + F.linear(attn, weights.o, weights.o_bias)
    x = rms_norm(hidden, weights.post_norm, weights.eps)
    gate, up = F.linear(x, weights.gate_up, weights.gate_up_bias).chunk(2, dim=-1)
    return hidden, F.linear(F.silu(gate) * up, weights.down, weights.down_bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm's arithmetic: the variance in fp32, cast back, then the weight."""
    dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps)).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of [T, heads, head_dim], rotate-half as LLaMA checkpoints use it."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# -- compiled once ----------------------------------------------------------------------------
class LayerPieces:
    """``pre`` and ``post`` (``pre_attention``, ``post_attention``), compiled when ``compile``.
    Compile on CUDA only: there the pieces save launches; on CPU the six graphs took 40 s to
    compile and ran slower than eager below a few hundred tokens (the demo model's shape; the
    guards cost more than the fusion saves), and tests build many models.

    One graph serves every layer and every token count T ≥ 2: ``dynamic=False`` keeps the
    weight shapes, head counts and eps static (``dynamic=True`` would make the head counts
    and head_dim symbolic: slower rotary and split kernels), and only the token dimension of
    the activations is marked dynamic at each call (``maybe_mark_dynamic``, about a µs), so
    prefills of any length and every decode bucket share it. Dynamo specialises T = 1, and the
    first layer's ``pre`` has no delta: six graphs a model (pre without and with a delta, post;
    at T = 1 and T ≥ 2). The default mode only: ``reduce-overhead`` would capture CUDA graphs
    of its own inside the engine's. ``backend``: torch.compile's.

    A compile (or compiled call) that raises switches both pieces to eager for good: logged
    once, counted in ``compile_fallbacks``, and the call runs again eagerly (the pieces are
    pure, so nothing was half done)."""

    def __init__(self, compile: bool, backend="inductor"):
        self.compiled = compile
        self.compile_fallbacks = 0
        self._pre = self._post = None
        if compile:  # compiled in the engine loop's thread, in process (llava.exec.compiler)
            options = {"fullgraph": True, "dynamic": False, "backend": backend}
            self._pre = torch.compile(pre_attention, **options)
            self._post = torch.compile(post_attention, **options)

    def pre(self, hidden, delta, weights: LayerWeights, cos, sin):
        """``pre_attention``: (q, k, v, hidden)."""
        return self._run(self._pre, pre_attention, hidden, delta, weights, cos, sin)

    def post(self, attn, hidden, weights: LayerWeights):
        """``post_attention``: (hidden, mlp_out)."""
        return self._run(self._post, post_attention, attn, hidden, weights)

    @torch.inference_mode()
    def warm_up(self, weights: LayerWeights, rows: Sequence[int] = (1, 2)) -> None:
        """Make every graph a step can need now (one piece call per graph, on zeros), so the
        compile, or its failure, comes at start and not in a request. Under inference mode,
        as the runner's steps run: dynamo guards on it."""
        like = {"dtype": weights.qkv.dtype, "device": weights.qkv.device}
        hidden_size, heads_width = weights.input_norm.shape[0], weights.heads * weights.head_dim
        for tokens in rows:
            # Distinct tensors throughout: dynamo guards on aliasing, so one tensor passed as
            # two inputs would make a graph no step uses.
            hidden = torch.zeros(tokens, hidden_size, **like)
            delta = torch.zeros(tokens, hidden_size, **like)
            cos = torch.ones(tokens, 1, weights.head_dim, **like)
            sin = torch.zeros(tokens, 1, weights.head_dim, **like)
            self.pre(hidden, None, weights, cos, sin)
            self.pre(hidden, delta, weights, cos, sin)
            self.post(torch.zeros(tokens, heads_width, **like), hidden, weights)

    def _run(self, compiled, eager, *args):
        if self.compiled:
            for arg in args:  # every tensor argument but the weights is [T, ...]
                if isinstance(arg, torch.Tensor):
                    torch._dynamo.maybe_mark_dynamic(arg, 0)
            try:
                return compiled(*args)
            except torch.cuda.OutOfMemoryError:
                raise
            except Exception as e:
                self._fall_back(e)
        return eager(*args)

    def _fall_back(self, error: Exception) -> None:
        self.compiled = False
        self.compile_fallbacks += 1
        logger.warning("compiled layer pieces failed, running them eagerly: %s", _cause(error))
        logger.debug("the compiled layer pieces' error", exc_info=error)


def _cause(error: BaseException) -> str:
    """One line naming the error and what raised it: dynamo wraps a backend's error in
    BackendCompilerFailed, whose first line names only the backend."""
    root, seen = error, set()
    while id(root) not in seen:  # a chain that loops back ends there
        seen.add(id(root))
        root = getattr(root, "inner_exception", None) or root.__cause__ or root
    if root is error:
        return one_line(error)
    return f"{type(error).__name__} from {one_line(root)}"
