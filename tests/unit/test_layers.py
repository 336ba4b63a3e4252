"""llava.exec.layers against the layers' own modules (fp32, CPU, tiny random LLaVAs).

Oracles: the model's own forward (HF's, unchanged by the merge), and the layer computed from
its modules as the runner does it (input_layernorm, q/k/v_proj, HF's rotary, o_proj,
post_attention_layernorm, mlp), with one causal SDPA standing in for the paged attention.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from transformers import LlavaConfig, LlavaForConditionalGeneration
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from llava.exec.layers import LayerPieces, merge_problem, merge_projections

# Grouped KV heads with biases everywhere (llama), and one KV head per query head with no bias
# (mistral): both merge paths and both attention shapes.
TEXT_MODELS = {
    "llama-gqa-bias": {"model_type": "llama", "num_key_value_heads": 2, "bias": True},
    "mistral-mha": {"model_type": "mistral", "num_key_value_heads": 4, "bias": False},
}


def tiny_llava(model_type="llama", num_key_value_heads=2, bias=True, hidden_act="silu"):
    text = {
        "model_type": model_type, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, "vocab_size": 100,
        "num_key_value_heads": num_key_value_heads, "hidden_act": hidden_act,
        "attention_bias": bias, "mlp_bias": bias,
    }  # fmt: skip
    vision = {
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 2, "image_size": 28, "patch_size": 14, "projection_dim": 32,
    }  # fmt: skip
    torch.manual_seed(0)
    config = LlavaConfig(text_config=text, vision_config=vision, image_token_id=99)
    model = LlavaForConditionalGeneration(config).float().eval()
    with torch.no_grad():  # biases start at zero and norms at one: randomise so a slip shows
        for name, parameter in model.model.language_model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.5)
            elif "norm" in name:
                parameter.normal_(1, 0.2)
    return model


@pytest.fixture(params=sorted(TEXT_MODELS))
def model(request):
    return tiny_llava(**TEXT_MODELS[request.param])


def hf_hidden(model, tokens: int) -> torch.Tensor:
    """The text model's own forward over ``tokens`` fixed embeddings (seed 1): its
    last_hidden_state, after the final norm."""
    torch.manual_seed(1)
    embeds = torch.randn(1, tokens, model.config.text_config.hidden_size)
    with torch.inference_mode():
        return model.model.language_model(inputs_embeds=embeds).last_hidden_state[0]


def storage_bytes(model) -> int:
    storages = {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()
    }
    return sum(storages.values())


# -- the merge ---------------------------------------------------------------------------------
def test_merge_keeps_names_values_and_forward_with_no_new_bytes(model):
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    before_bytes, before_out = storage_bytes(model), hf_hidden(model, 7)

    assert merge_problem(model) is None
    weights = merge_projections(model)

    assert len(weights) == 3
    after = model.state_dict()
    assert list(after) == list(state)
    assert all(torch.equal(after[name], state[name]) for name in state)
    assert storage_bytes(model) == before_bytes
    assert sum(p.numel() for p in model.parameters()) == sum(t.numel() for t in state.values())
    assert torch.equal(hf_hidden(model, 7), before_out)


def test_projections_are_views_of_the_merged_tensors(model):
    weights = merge_projections(model)
    for layer, w in zip(model.model.language_model.layers, weights, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        for merged, parts in (
            (w.qkv, (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)),
            (w.gate_up, (mlp.gate_proj.weight, mlp.up_proj.weight)),
            (w.qkv_bias, (attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias)),
            (w.gate_up_bias, (mlp.gate_proj.bias, mlp.up_proj.bias)),
        ):
            if merged is None:
                assert all(part is None for part in parts)
                continue
            assert merged.shape[0] == sum(part.shape[0] for part in parts)
            at = merged.data_ptr()
            for part in parts:
                assert isinstance(part, torch.nn.Parameter)
                assert part.data_ptr() == at  # the part's rows of the merged storage
                at += part.numel() * part.element_size()


def test_merge_is_idempotent_and_a_loaded_checkpoint_shows_in_the_merged_tensors(model):
    first = merge_projections(model)
    second = merge_projections(model)
    assert [w.qkv.data_ptr() for w in first] == [w.qkv.data_ptr() for w in second]
    assert [w.gate_up.data_ptr() for w in first] == [w.gate_up.data_ptr() for w in second]

    state = {name: torch.randn_like(tensor) for name, tensor in model.state_dict().items()}
    model.load_state_dict(state)
    prefix = "model.language_model.layers.0."
    qkv = [state[prefix + f"self_attn.{p}_proj.weight"] for p in "qkv"]
    gate_up = [state[prefix + f"mlp.{p}_proj.weight"] for p in ("gate", "up")]
    assert torch.equal(second[0].qkv, torch.cat(qkv))
    assert torch.equal(second[0].gate_up, torch.cat(gate_up))


@pytest.mark.parametrize(
    ("unfit", "problem"),
    [
        ("k_proj without bias", "decoder layer 2: some of q/k/v or of gate/up with a bias"),
        ("gelu", "activation 'gelu'"),
    ],
)
def test_a_model_that_does_not_fit_is_refused_with_nothing_changed(unfit, problem):
    model = tiny_llava(hidden_act="gelu" if unfit == "gelu" else "silu")
    if unfit == "k_proj without bias":
        model.model.language_model.layers[2].self_attn.k_proj.bias = None
    pointers = {name: p.data_ptr() for name, p in model.named_parameters()}

    assert merge_problem(model).startswith(problem)
    assert merge_projections(model) is None
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == pointers


# -- the pieces --------------------------------------------------------------------------------
def rotary(model, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, 1, head_dim] at positions 0..T-1, as the runner makes them."""
    positions = torch.arange(hidden.shape[0])[None]
    cos, sin = model.model.language_model.rotary_emb(hidden, positions)
    return cos[0, :, None, :], sin[0, :, None, :]


def attend(q, k, v) -> torch.Tensor:
    """Causal attention over the packed tokens (one sequence): [T, heads × head_dim]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    )
    return out.transpose(0, 1).reshape(q.shape[0], -1)


def module_layers(model, hidden: torch.Tensor) -> tuple[torch.Tensor, list]:
    """The layers from their own modules, as Runner._forward runs them; the final hidden
    (before the final norm) and each layer's (q, k, v)."""
    tokens, (cos, sin) = hidden.shape[0], rotary(model, hidden)
    seen = []
    for layer in model.model.language_model.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        q = attn.q_proj(x).view(tokens, -1, attn.head_dim)
        k = attn.k_proj(x).view(tokens, -1, attn.head_dim)
        v = attn.v_proj(x).view(tokens, -1, attn.head_dim)
        q, k = apply_rotary_pos_emb(q, k, cos[:, 0], sin[:, 0], unsqueeze_dim=1)
        seen.append((q, k, v))
        hidden = hidden + attn.o_proj(attend(q, k, v))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return hidden, seen


def piece_layers(pieces: LayerPieces, weights, model, hidden: torch.Tensor):
    """The same through the pieces, chained as the runner will chain them."""
    cos, sin = rotary(model, hidden)
    delta, seen = None, []
    for w in weights:
        q, k, v, hidden = pieces.pre(hidden, delta, w, cos, sin)
        seen.append((q, k, v))
        hidden, delta = pieces.post(attend(q, k, v), hidden, w)
    return hidden + delta, seen


def embeds(tokens: int, seed: int = 2) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(tokens, 64)


@torch.inference_mode()
def test_eager_pieces_equal_the_layers_modules_and_the_models_forward(model):
    weights = merge_projections(model)
    for tokens in (1, 7):
        expected, expected_qkv = module_layers(model, embeds(tokens))
        got, got_qkv = piece_layers(LayerPieces(compile=False), weights, model, embeds(tokens))
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got_qkv, expected_qkv, rtol=1e-6, atol=1e-6)

    norm = model.model.language_model.norm
    hf = hf_hidden(model, 7)  # the same embeddings (seed 1)
    torch.manual_seed(1)
    ours, _ = piece_layers(LayerPieces(compile=False), weights, model, torch.randn(7, 64))
    torch.testing.assert_close(norm(ours), hf, rtol=1e-5, atol=1e-5)


class CountingBackend:
    """A torch.compile backend that counts the graphs it is given, then runs each as traced
    (or hands it on to ``then``)."""

    def __init__(self, then=None):
        self.graphs = 0
        self.then = then

    def __call__(self, graph, inputs):
        self.graphs += 1
        return graph.forward if self.then is None else self.then(graph, inputs)


# torch.compile traces every piece at five token counts (seconds on a CPU): make test-fast keeps
# the eager pieces (test_eager_pieces_equal_the_layers_modules_and_the_models_forward) and
# the compile path's fallback (test_a_compile_that_raises_falls_back_to_eager_once).
@pytest.mark.thorough
@torch.inference_mode()
def test_one_graph_per_piece_serves_every_layer_and_token_count():
    """Warm-up makes all six graphs (pre without and with a delta, post; at one token and at
    many); no layer and no later token count makes another."""
    model = tiny_llava()
    weights = merge_projections(model)
    backend = CountingBackend()
    pieces = LayerPieces(compile=True, backend=backend)

    pieces.warm_up(weights[0])
    assert backend.graphs == 6

    eager = LayerPieces(compile=False)
    for tokens in (5, 1, 9, 2, 33):
        got, got_qkv = piece_layers(pieces, weights, model, embeds(tokens))
        expected, expected_qkv = piece_layers(eager, weights, model, embeds(tokens))
        assert torch.equal(got, expected)
        assert all(map(torch.equal, sum(got_qkv, ()), sum(expected_qkv, ())))
    assert backend.graphs == 6
    assert pieces.compiled and pieces.compile_fallbacks == 0


def failing_backend(graph, inputs):
    raise RuntimeError("no compiler here\nsecond line")


@pytest.mark.parametrize(  # the fallback is the same for both: make test-fast keeps llama's
    "model",
    ["llama-gqa-bias", pytest.param("mistral-mha", marks=pytest.mark.thorough)],
    indirect=True,
)
@torch.inference_mode()
def test_a_compile_that_raises_falls_back_to_eager_once(model, caplog):
    weights = merge_projections(model)
    pieces = LayerPieces(compile=True, backend=failing_backend)

    with caplog.at_level(logging.WARNING, logger="llava.exec.layers"):
        got, _ = piece_layers(pieces, weights, model, embeds(6))
        again, _ = piece_layers(pieces, weights, model, embeds(6))

    expected, _ = piece_layers(LayerPieces(compile=False), weights, model, embeds(6))
    assert torch.equal(got, expected) and torch.equal(again, expected)
    assert not pieces.compiled and pieces.compile_fallbacks == 1
    (record,) = [r for r in caplog.records if r.name == "llava.exec.layers"]
    assert record.getMessage().endswith("BackendCompilerFailed from RuntimeError: no compiler here")


@torch.inference_mode()
def test_warm_up_meets_a_failing_compile_at_start():
    weights = merge_projections(tiny_llava())
    pieces = LayerPieces(compile=True, backend=failing_backend)
    pieces.warm_up(weights[0])
    assert not pieces.compiled and pieces.compile_fallbacks == 1


@pytest.mark.thorough
@torch.inference_mode()
def test_inductor_pieces_equal_eager_in_fp32_and_near_it_in_bf16():
    """The real compile (inductor, C++ on CPU, about a minute here): six graphs for every
    layer and token count; fp32 equal to eager within 1e-5; bf16 near eager."""
    model = tiny_llava()
    weights = merge_projections(model)
    backend = CountingBackend(then=torch._dynamo.lookup_backend("inductor"))
    pieces, eager = LayerPieces(compile=True, backend=backend), LayerPieces(compile=False)
    pieces.warm_up(weights[0])
    for tokens in (1, 7, 12):
        got, _ = piece_layers(pieces, weights, model, embeds(tokens))
        expected, _ = piece_layers(eager, weights, model, embeds(tokens))
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert backend.graphs == 6 and pieces.compiled

    model = model.to(torch.bfloat16)
    weights = merge_projections(model)  # the move copied each parameter apart: merge again
    got, _ = piece_layers(pieces, weights, model, embeds(7).bfloat16())
    expected, _ = piece_layers(eager, weights, model, embeds(7).bfloat16())
    # Inductor computes a fused chain in fp32 and rounds once; eager rounds each op to bf16.
    # Measured: at most 2**-6 apart; the outputs reach 4.7, where one bf16 step is 2**-5.
    torch.testing.assert_close(got, expected, rtol=0, atol=2**-5)
    assert pieces.compiled
