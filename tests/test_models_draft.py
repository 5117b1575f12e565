"""z-lab checkpoints (both config schemas, single file and sharded) load into DFlashDraftModel, and
its draft logits equal an eager implementation of docs/design.md §1 written here from the spec."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from sglang_dflash import ops
from sglang_dflash.models import DFlashConfig, load_draft, save_draft

H, HQ, HKV, D, FFN, VOCAB, TARGET_LAYERS = 48, 4, 2, 16, 80, 120, 10
EPS, THETA = 1e-6, 10000.0


def zlab_config(schema: str, layers: int, taps: list[int], block_size: int, window: int | None,
                causal: bool, bias: bool) -> dict:
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_act": "silu",
        "hidden_size": H, "intermediate_size": FFN, "num_hidden_layers": layers,
        "num_attention_heads": HQ, "num_key_value_heads": HKV, "head_dim": D, "vocab_size": VOCAB,
        "rms_norm_eps": EPS, "max_position_embeddings": 4096, "attention_bias": bias,
        "num_target_layers": TARGET_LAYERS,
        "dflash_config": {"mask_token_id": VOCAB - 1, "target_layer_ids": taps},
    }
    if schema == "v1":  # original z-lab: block_size and rope_theta at top level
        cfg.update(block_size=block_size, rope_theta=THETA)
    else:  # newer z-lab: dflash_config.block_size, rope_parameters, sliding layers, causal flag
        cfg["dflash_config"].update(block_size=block_size, causal=causal)
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": THETA}
        if window is not None:
            cfg["layer_types"] = ["sliding_attention"] + ["full_attention"] * (layers - 1)
            cfg["sliding_window"] = window
    return cfg


def zlab_tensors(layers: int, taps: int, bias: bool, gen: torch.Generator) -> dict[str, torch.Tensor]:
    def rnd(*shape, scale=0.15):
        return torch.randn(*shape, generator=gen) * scale

    def norm(n):
        return 1.0 + rnd(n, scale=0.2)

    t = {"fc.weight": rnd(H, taps * H), "hidden_norm.weight": norm(H), "norm.weight": norm(H)}
    for i in range(layers):
        p = f"layers.{i}."
        t[p + "self_attn.q_proj.weight"] = rnd(HQ * D, H)
        t[p + "self_attn.k_proj.weight"] = rnd(HKV * D, H)
        t[p + "self_attn.v_proj.weight"] = rnd(HKV * D, H)
        t[p + "self_attn.o_proj.weight"] = rnd(H, HQ * D)
        if bias:
            t[p + "self_attn.q_proj.bias"] = rnd(HQ * D)
            t[p + "self_attn.k_proj.bias"] = rnd(HKV * D)
            t[p + "self_attn.v_proj.bias"] = rnd(HKV * D)
            t[p + "self_attn.o_proj.bias"] = rnd(H)
        t[p + "self_attn.q_norm.weight"] = norm(D)
        t[p + "self_attn.k_norm.weight"] = norm(D)
        t[p + "mlp.gate_proj.weight"] = rnd(FFN, H)
        t[p + "mlp.up_proj.weight"] = rnd(FFN, H)
        t[p + "mlp.down_proj.weight"] = rnd(H, FFN)
        t[p + "input_layernorm.weight"] = norm(H)
        t[p + "post_attention_layernorm.weight"] = norm(H)
    return t


def write_checkpoint(directory, cfg: dict, tensors: dict, sharded: bool, dtype: torch.dtype) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    tensors = {k: v.to(dtype) for k, v in tensors.items()}
    if not sharded:
        save_file(tensors, directory / "model.safetensors")
        return
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, directory / fname)
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def reference_draft_logits(w: dict, layers: int, ctx_hidden: torch.Tensor, block_emb: torch.Tensor,
                           lm_head: torch.Tensor, window: int | None, causal: bool) -> torch.Tensor:
    """docs/design.md §1, eagerly, for one request: context of S tokens at positions 0..S-1,
    block of B rows at S..S+B-1. Returns the logits of block rows 1..B-1."""
    w = {k: v.double() for k, v in w.items()}
    ctx_hidden, block_emb, lm_head = ctx_hidden.double(), block_emb.double(), lm_head.double()

    def rms(x, weight):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)

    def linear(x, name):
        y = x @ w[name + ".weight"].T
        return y + w[name + ".bias"] if name + ".bias" in w else y

    s, b = ctx_hidden.shape[0], block_emb.shape[0]
    pos = torch.arange(s + b, dtype=torch.float64)
    inv_freq = THETA ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = pos[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)

    def rope(x, p):  # x [T, heads, D]; rotate pairs (i, i + D/2)
        x1, x2 = x[..., :D // 2], x[..., D // 2:]
        return x * cos[p, None] + torch.cat([-x2, x1], -1) * sin[p, None]

    ctx = rms(ctx_hidden @ w["fc.weight"].T, w["hidden_norm.weight"])
    h = block_emb
    q_pos, k_pos = pos[s:], pos
    for i in range(layers):
        p = f"layers.{i}."
        x = rms(h, w[p + "input_layernorm.weight"])
        q = rope(rms(linear(x, p + "self_attn.q_proj").view(b, HQ, D), w[p + "self_attn.q_norm.weight"]),
                 torch.arange(s, s + b))
        k_in = torch.cat([ctx, x])  # context rows see no input_layernorm
        k = rope(rms(linear(k_in, p + "self_attn.k_proj").view(s + b, HKV, D), w[p + "self_attn.k_norm.weight"]),
                 torch.arange(s + b))
        v = linear(k_in, p + "self_attn.v_proj").view(s + b, HKV, D)
        k, v = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
        visible = torch.ones(b, s + b, dtype=torch.bool)
        if causal:
            visible[:, s:] = torch.ones(b, b).tril().bool()
        if window is not None and i == 0:
            visible &= (q_pos[:, None] - k_pos[None]).abs() < window
        scores = scores.masked_fill(~visible, float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(b, HQ * D)
        h = h + linear(attn, p + "self_attn.o_proj")
        y = rms(h, w[p + "post_attention_layernorm.weight"])
        gate, up = y @ w[p + "mlp.gate_proj.weight"].T, y @ w[p + "mlp.up_proj.weight"].T
        h = h + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return (rms(h, w["norm.weight"])[1:] @ lm_head.T).float()


CASES = {
    "v1": dict(schema="v1", layers=2, taps=[1, 4, 7], window=None, causal=False, bias=False,
               sharded=False, dtype=torch.bfloat16),
    "v2-sliding-sharded": dict(schema="v2", layers=3, taps=[1, 5], window=6, causal=False, bias=True,
                               sharded=True, dtype=torch.float32),
    "v2-causal": dict(schema="v2", layers=2, taps=[2, 3, 6, 8], window=None, causal=True, bias=False,
                      sharded=False, dtype=torch.float32),
}


@pytest.mark.parametrize("path", ["kernels", "pytorch"])
@pytest.mark.parametrize("case", list(CASES))
def test_zlab_checkpoint_matches_reference(tmp_path, monkeypatch, case, path):
    """`path`: the CPU inference kernels (rms_norm_rope, materialize_context_kv), or the PyTorch
    math the model runs where they do not serve (training, other devices, a failed self-test)."""
    if path == "pytorch":
        monkeypatch.setattr(ops, "_REFERENCE_ON", {(op, torch.device("cpu"))
                                                   for op in ("rms_norm_rope", "materialize_context_kv")})
    c = CASES[case]
    block_size, gen = 6, torch.Generator().manual_seed(list(CASES).index(case))
    cfg = zlab_config(c["schema"], c["layers"], c["taps"], block_size, c["window"], c["causal"], c["bias"])
    tensors = zlab_tensors(c["layers"], len(c["taps"]), c["bias"], gen)
    write_checkpoint(tmp_path / "ckpt", cfg, tensors, c["sharded"], c["dtype"])
    model = load_draft(tmp_path / "ckpt")
    weights = {k: v.to(c["dtype"]).float() for k, v in tensors.items()}  # what the file holds

    assert model.config.block_size == block_size
    assert model.config.target_layer_ids == tuple(c["taps"])
    k_h = len(c["taps"]) * H
    embed = torch.randn(VOCAB, H, generator=gen)
    lm_head = torch.randn(VOCAB, H, generator=gen) * 0.3
    # Two requests with ragged contexts, appended in two chunks each (prefill, then one step).
    contexts = [torch.randn(9, k_h, generator=gen), torch.randn(4, k_h, generator=gen)]
    model.allocate_cache(num_slots=32, max_requests=3, max_context=16)
    reqs = [model.cache.add_request() for _ in contexts]
    model.append_context(reqs, [7, 1], torch.cat([contexts[0][:7], contexts[1][:1]]))
    model.append_context(reqs, [2, 3], torch.cat([contexts[0][7:], contexts[1][1:]]))
    anchors = [5, 17]
    block = torch.full((2, block_size), VOCAB - 1)
    block[:, 0] = torch.tensor(anchors)
    hidden = model(embed[block].reshape(-1, H), torch.tensor(reqs), block_size)
    logits = model.logits(hidden.view(2, block_size, H)[:, 1:], lm_head)
    for b in range(2):
        want = reference_draft_logits(weights, c["layers"], contexts[b], embed[block[b]], lm_head,
                                      c["window"], c["causal"])
        torch.testing.assert_close(logits[b], want, rtol=1e-4, atol=1e-4)


def test_save_then_load_round_trips(tmp_path):
    gen = torch.Generator().manual_seed(3)
    cfg = zlab_config("v2", 2, [1, 6], 8, 5, False, True)
    write_checkpoint(tmp_path / "a", cfg, zlab_tensors(2, 2, True, gen), False, torch.float32)
    model = load_draft(tmp_path / "a")
    save_draft(model, tmp_path / "b")
    again = load_draft(tmp_path / "b")
    assert again.config == model.config
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]), name
    # The written config parses with both schema readers' fields present.
    written = json.loads((tmp_path / "b" / "config.json").read_text())
    assert written["block_size"] == written["dflash_config"]["block_size"] == 8
    assert DFlashConfig.from_dict(written) == model.config


def test_quantize_weights_keeps_the_draft_close_and_cannot_be_saved(tmp_path):
    """int8 weights (inference): fc and every projection but k_proj / v_proj (which
    materialize_context_kv reads in the model's dtype) become Int8Linear; the draft's hidden states
    stay within int8 rounding of the bf16 model's; a quantized model is not written as a checkpoint."""
    from sglang_dflash.models.skinny import Int8Linear

    gen = torch.Generator().manual_seed(5)
    cfg = zlab_config("v2", 2, [1, 6], 8, 5, False, True)
    write_checkpoint(tmp_path / "a", cfg, zlab_tensors(2, 2, True, gen), False, torch.float32)
    outputs = []
    for quantize in (False, True):
        model = load_draft(tmp_path / "a", dtype=torch.bfloat16)
        if quantize:
            assert model.quantize_weights() == 1 + 2 * 5
            assert isinstance(model.fc, Int8Linear) and isinstance(model.layers[1].mlp.down_proj, Int8Linear)
            attn = model.layers[0].self_attn
            assert attn.k_proj.weight.dtype == attn.v_proj.weight.dtype == torch.bfloat16
            assert model.dtype == torch.bfloat16
        h = model.config.hidden_size
        model.allocate_cache(64, 1, 32)
        rows = [model.cache.add_request()]
        context = torch.randn(5, model.fc.in_features, generator=torch.Generator().manual_seed(7))
        model.append_context(rows, [5], context.bfloat16())
        block = torch.randn(4, h, generator=torch.Generator().manual_seed(9)).bfloat16()
        outputs.append(model(block, torch.tensor(rows), 4).float())
        if quantize:
            with pytest.raises(ValueError, match="int8 weights"):
                save_draft(model, tmp_path / "b")
    full, quantized = outputs
    assert (quantized - full).norm() / full.norm() < 0.05
    assert not torch.equal(quantized, full)
