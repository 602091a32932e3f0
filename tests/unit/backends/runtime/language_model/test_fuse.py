"""Fused q/k/v and gate/up projections compute what transformers' layers compute, with one copy of the weights."""
import pytest
import torch

from backends.runtime.language_model.fuse import FusedGateUpMLP, FusedQKVAttention, fuse_projections
from backends.runtime.loader import ModelSpec, load_model


def _lm():
    model, _ = load_model(ModelSpec(dtype="float32"))
    model.model.language_model.set_attn_implementation("sdpa")
    return model.model.language_model.double()


def test_fused_layers_give_transformers_output():
    plain, fused = _lm(), _lm()  # the loader's dummy weights are seeded: the same in both
    fuse_projections(fused)
    ids = torch.randint(0, plain.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(11).expand(3, 2, -1)  # M-RoPE: the three axes equal for text
    with torch.no_grad():
        want = plain(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
        got = fused(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_eager_attention_weights_come_back_as_transformers_gives_them():
    plain, fused = _lm(), _lm()
    for lm in (plain, fused):
        lm.set_attn_implementation("eager")
    fuse_projections(fused)
    ids = torch.tensor([[5, 9, 2, 7]])
    with torch.no_grad():
        want = plain(input_ids=ids, use_cache=False, output_attentions=True).attentions
        got = fused(input_ids=ids, use_cache=False, output_attentions=True).attentions
    assert len(got) == len(want) == plain.config.num_hidden_layers
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_one_copy_of_the_weights_and_idempotent():
    lm = _lm()
    before = sum(p.numel() for p in lm.parameters())
    q_weight = lm.layers[0].self_attn.q_proj.weight.clone()
    fuse_projections(lm)
    fuse_projections(lm)
    attn, mlp = lm.layers[0].self_attn, lm.layers[0].mlp
    assert isinstance(attn, FusedQKVAttention) and isinstance(mlp, FusedGateUpMLP)
    assert sum(p.numel() for p in lm.parameters()) == before
    assert not hasattr(attn, "q_proj") and not hasattr(mlp, "up_proj")
    torch.testing.assert_close(attn.qkv_proj.weight[:q_weight.shape[0]], q_weight, rtol=0, atol=0)


def test_refuses_a_transformers_cache():
    lm = _lm()
    fuse_projections(lm)
    with pytest.raises(ValueError, match="no transformers KV cache"):
        lm(input_ids=torch.tensor([[1, 2]]), use_cache=True)


def test_rejects_other_layers():
    with pytest.raises(TypeError, match="Qwen2.5-VL decoder layers"):
        fuse_projections(_Stack())


class _Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = torch.nn.Module()
        layer.self_attn, layer.mlp = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        self.layers = torch.nn.ModuleList([layer])
