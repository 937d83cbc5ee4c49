"""cubeattn as a transformers attention implementation (marked `torch`; skipped where torch or
transformers is not installed): small randomly initialised Llama / Mistral / Qwen2 models
(float32, CPU, no weights downloaded) with attn_implementation="cubeattn" give the logits and
gradients of the same model with "eager" / "sdpa": batched, GQA, sliding window, left and right
padding, packed sequences (position_ids and cu_seq_lens kwargs), cached generation."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import cubeattn.integrations.transformers as hf  # noqa: E402  (registers "cubeattn")

pytestmark = pytest.mark.torch

# logits and gradients of float32 models: only the summation order differs
LOGIT_TOL, GRAD_REL = 1e-4, 1e-4


def llama(**over):
    cfg = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256)
    cfg.update(over)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()


def mistral(window):
    torch.manual_seed(1)
    cfg = transformers.MistralConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
                                     sliding_window=window, head_dim=16)
    return transformers.MistralForCausalLM(cfg).eval()


def qwen2(window):
    """Qwen2 with sliding-window attention in its second layer only (max_window_layers=1)."""
    torch.manual_seed(2)
    cfg = transformers.Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   use_sliding_window=True, sliding_window=window, max_window_layers=1)
    return transformers.Qwen2ForCausalLM(cfg).eval()


def run(model, impl, ids, grad_rows=None, **kw):
    """(logits, parameter grads) of `model` under `impl`; the loss is a fixed random projection of
    the logits at `grad_rows` (a bool [batch, seqlen] mask; all rows by default)."""
    model.set_attn_implementation(impl)
    model.zero_grad()
    logits = model(ids, **kw).logits
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3))
    if grad_rows is not None:
        w = w * grad_rows[..., None]
    (logits * w).sum().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def assert_match(got, want, rows=None):
    (lg, gg), (lw, gw) = got, want
    if rows is not None:
        lg, lw = lg[rows], lw[rows]
    np.testing.assert_allclose(lg.numpy(), lw.numpy(), rtol=LOGIT_TOL, atol=LOGIT_TOL)
    assert len(gg) == len(gw) > 0
    for a, b in zip(gg, gw):
        assert torch.isfinite(a).all()
        assert (a - b).norm() <= GRAD_REL * b.norm() + 1e-7, ((a - b).norm(), b.norm())


def ids_for(batch, seqlen, seed=4):
    return torch.randint(0, 97, (batch, seqlen), generator=torch.Generator().manual_seed(seed))


def test_registered_names():
    assert "cubeattn" in transformers.AttentionInterface().valid_keys()
    assert hf.register("cubeattn_again") == "cubeattn_again"
    assert transformers.AttentionInterface()["cubeattn_again"] is hf.attention_forward


@pytest.mark.parametrize("ref", ["eager", "sdpa"])
def test_llama_gqa_logits_and_grads_match(ref):
    model, ids = llama(), ids_for(3, 37)
    assert_match(run(model, "cubeattn", ids), run(model, ref, ids))


def test_llama_without_gqa_and_bidirectional():
    """num_key_value_heads == heads, and a non-causal model (config.is_causal=False)."""
    model, ids = llama(num_key_value_heads=4), ids_for(2, 21)
    assert_match(run(model, "cubeattn", ids), run(model, "sdpa", ids))
    model = llama(is_causal=False)
    for layer in model.model.layers:
        layer.self_attn.is_causal = False
    assert_match(run(model, "cubeattn", ids), run(model, "eager", ids))


@pytest.mark.parametrize("make", [mistral, qwen2], ids=["mistral", "qwen2"])
def test_sliding_window_models_match(make):
    model, ids = make(7), ids_for(2, 40)  # a window much shorter than the sequence
    got = run(model, "cubeattn", ids)
    assert_match(got, run(model, "eager", ids))
    # the window matters: without it the logits differ
    wide = make(1000)
    wide.load_state_dict(model.state_dict())
    assert not torch.allclose(run(wide, "cubeattn", ids)[0], got[0], atol=1e-3)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_mask_matches_eager_on_valid_tokens(side):
    model, ids = llama(), ids_for(3, 30)
    mask = torch.ones(3, 30, dtype=torch.long)
    pad = {0: 0, 1: 11, 2: 29}  # row 2 keeps one token
    for r, n in pad.items():
        if n:
            if side == "left":
                mask[r, :n] = 0
            else:
                mask[r, -n:] = 0
    valid = mask.bool()
    got = run(model, "cubeattn", ids, valid, attention_mask=mask)
    assert_match(got, run(model, "eager", ids, valid, attention_mask=mask), rows=valid)


def test_packed_position_ids_match_separate_sequences():
    """Three sequences packed in one row with restarting position_ids (as transformers' data
    collators make them) equal each sequence run alone; cu_seq_lens kwargs give the same."""
    model = llama()
    lens = [9, 17, 6]
    seqs = [ids_for(1, n, seed=10 + i) for i, n in enumerate(lens)]
    packed = torch.cat(seqs, dim=1)
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    model.set_attn_implementation("cubeattn")
    with torch.no_grad():
        alone = torch.cat([model(s).logits for s in seqs], dim=1)
        by_pos = model(packed, position_ids=pos).logits
        cu = torch.tensor(np.cumsum([0] + lens), dtype=torch.int32)
        by_cu = model(packed, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lens),
                      max_length_k=max(lens)).logits
        model.set_attn_implementation("eager")
        # eager with the default use_cache=True reads no packing from position_ids (transformers'
        # masks look for it only without a cache): it attends across the sequences
        unpacked_eager = model(packed, position_ids=pos).logits
    np.testing.assert_allclose(by_pos.numpy(), alone.numpy(), rtol=LOGIT_TOL, atol=LOGIT_TOL)
    np.testing.assert_allclose(by_cu.numpy(), alone.numpy(), rtol=LOGIT_TOL, atol=LOGIT_TOL)
    assert not torch.allclose(unpacked_eager[:, lens[0]:], alone[:, lens[0]:], atol=1e-3)


def test_packed_rows_in_a_batch_train_like_separate_sequences():
    """Two rows, the second holding two packed sequences: grads equal the sdpa model run on the
    three sequences as a padded batch (loss over the valid tokens)."""
    model = llama()
    a, b, c = ids_for(1, 12, 20), ids_for(1, 5, 21), ids_for(1, 7, 22)
    ids = torch.cat([a, torch.cat([b, c], 1)], 0)
    pos = torch.stack([torch.arange(12), torch.cat([torch.arange(5), torch.arange(7)])])
    got = run(model, "cubeattn", ids, position_ids=pos)
    padded = torch.zeros(3, 12, dtype=torch.long)
    mask = torch.zeros(3, 12, dtype=torch.long)
    for r, s in enumerate((a, b, c)):
        padded[r, :s.shape[1]] = s[0]
        mask[r, :s.shape[1]] = 1
    model.set_attn_implementation("sdpa")
    model.zero_grad()
    logits = model(padded, attention_mask=mask).logits
    # the same loss: the packed run's weights, moved to where each token sits in the padded batch
    w = torch.randn((2, 12, 97), generator=torch.Generator().manual_seed(3))
    wp = torch.zeros(3, 12, 97)
    wp[0], wp[1, :5], wp[2, :7] = w[0], w[1, :5], w[1, 5:]
    (logits * wp).sum().backward()
    want_grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    lg = got[0]
    np.testing.assert_allclose(lg[0].numpy(), logits[0].detach().numpy(), rtol=LOGIT_TOL, atol=LOGIT_TOL)
    np.testing.assert_allclose(lg[1, :5].numpy(), logits[1, :5].detach().numpy(), rtol=LOGIT_TOL, atol=LOGIT_TOL)
    np.testing.assert_allclose(lg[1, 5:].numpy(), logits[2, :7].detach().numpy(), rtol=LOGIT_TOL, atol=LOGIT_TOL)
    for x, y in zip(got[1], want_grads):
        assert (x - y).norm() <= GRAD_REL * y.norm() + 1e-7


@pytest.mark.parametrize("padded", [False, True])
def test_cached_generation_matches_sdpa(padded):
    """Greedy generation with the KV cache (prefill, then one-token decode steps, sliding
    window included): the same tokens and step logits as sdpa."""
    for model in (llama(), mistral(5)):
        ids = ids_for(2, 11)
        mask = torch.ones_like(ids)
        if padded:
            mask[1, :4] = 0
        outs = {}
        for impl in ("sdpa", "cubeattn"):
            model.set_attn_implementation(impl)
            outs[impl] = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                        output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        assert torch.equal(outs["cubeattn"].sequences, outs["sdpa"].sequences)
        for a, b in zip(outs["cubeattn"].logits, outs["sdpa"].logits):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=LOGIT_TOL, atol=LOGIT_TOL)


def test_compiled_model_fullgraph_matches_eager():
    model, ids = llama(), ids_for(2, 19)
    model.set_attn_implementation("cubeattn")
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            want = model(ids).logits
            got = torch.compile(model, backend="aot_eager", fullgraph=True)(ids).logits
    finally:
        torch._dynamo.reset()
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=LOGIT_TOL, atol=LOGIT_TOL)


def test_unsupported_options_raise_naming_them():
    model = llama()
    attn = model.model.layers[0].self_attn
    q = torch.rand(1, 4, 6, 16)
    kv = torch.rand(1, 2, 6, 16)
    with pytest.raises(NotImplementedError, match="softcap"):
        hf.attention_forward(attn, q, kv, kv, None, softcap=30.0)
    with pytest.raises(NotImplementedError, match="s_aux"):
        hf.attention_forward(attn, q, kv, kv, None, s_aux=torch.zeros(4))
    with pytest.raises(NotImplementedError, match="dropout_p"):
        hf.attention_forward(attn, q, kv, kv, None, dropout=0.1)
    with pytest.raises(ValueError, match="4-D mask"):
        hf.attention_forward(attn, q, kv, kv, torch.ones(1, 1, 6, 6, dtype=torch.bool))
