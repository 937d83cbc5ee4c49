"""cubeattn as a transformers attention implementation on CUDA (marked `gpu` and `torch`; skipped
without a GPU, torch or transformers): bf16 Llama and Mistral (sliding window) models give
sdpa's logits and gradients within bf16 rounding, padded and packed batches included, and the
calls run on the CUDA backend."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import cubeattn  # noqa: E402
import cubeattn.integrations.transformers  # noqa: E402,F401  (registers "cubeattn")
from conftest import cuda_available  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.torch,
              pytest.mark.skipif(not (torch.cuda.is_available() and cuda_available()), reason="needs a CUDA GPU")]


def model_of(kind):
    torch.manual_seed(0)
    common = dict(vocab_size=1000, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
    if kind == "llama":
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        m = transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=100, head_dim=64))
    return m.to("cuda", torch.bfloat16)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def logits_and_grads(model, impl, ids, **kw):
    model.set_attn_implementation(impl)
    model.zero_grad()
    out = model(ids, labels=ids, **kw)
    out.loss.backward()
    return out.logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_gpu_model_matches_sdpa(kind):
    model = model_of(kind)
    ids = torch.randint(0, 1000, (2, 384), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    got = logits_and_grads(model, "cubeattn", ids)
    assert cubeattn.last_backend() == "cuda"
    want = logits_and_grads(model, "sdpa", ids)
    assert rel(got[0], want[0]) < 2e-2
    for a, b in zip(got[1], want[1]):
        assert rel(a, b) < 5e-2


def test_gpu_padded_and_packed_batches_match_sdpa():
    model = model_of("llama")
    gen = torch.Generator("cuda").manual_seed(2)
    ids = torch.randint(0, 1000, (2, 200), device="cuda", generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :70] = 0
    with torch.no_grad():
        model.set_attn_implementation("cubeattn")
        got = model(ids, attention_mask=mask).logits
        model.set_attn_implementation("sdpa")
        want = model(ids, attention_mask=mask).logits
        valid = mask.bool()
        assert rel(got[valid], want[valid]) < 2e-2
        # packed: two sequences in one row vs each alone
        a, b = ids[:1, :120], ids[1:, 70:]
        pos = torch.cat([torch.arange(120), torch.arange(130)]).to("cuda")[None]
        model.set_attn_implementation("cubeattn")
        packed = model(torch.cat([a, b], 1), position_ids=pos).logits
        model.set_attn_implementation("sdpa")
        alone = torch.cat([model(a).logits, model(b).logits], 1)
    assert rel(packed, alone) < 2e-2
