"""Client benchmark (``python -m cubeattn.bench hf_train --json client.json``): a transformers Llama
(random initialisation, no weights downloaded; 8 layers, 16 query / 4 key-value heads of 128)
trained a few steps in bf16 with attn_implementation="cubeattn" beside "sdpa", in the same
process, from the same initial weights on the same tokens; one plain causal batch and one row of
four packed sequences (position_ids restarting; sdpa then builds a 4-D mask). Rows
``what: hf_train`` per impl: ms/step (median after the warm-up steps), first and last loss, and on
the cubeattn row the largest |loss - sdpa's loss| over the steps."""
from __future__ import annotations

import time


def _train(torch, model, ids, position_ids, steps):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    losses, ms = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        loss = model(ids, labels=ids, position_ids=position_ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # waits for the step
        ms.append((time.perf_counter() - t) * 1e3)
    del opt
    return losses, ms


def hf_train(args, torch):
    import transformers

    import cubeattn.integrations.transformers  # noqa: F401  (registers "cubeattn")

    steps = args.iterations or (8 if args.quick else 25)
    warm = min(3, steps - 1)
    rows = []
    for s in args.seqlens:
        cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                                       num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=s)
        with torch.device("cuda"):
            torch.manual_seed(0)
            model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
        init = {k: v.clone() for k, v in model.state_dict().items()}
        ids = torch.randint(0, cfg.vocab_size, (1, s), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        for packed in (1, 4):
            pos = torch.arange(s // packed, device="cuda").repeat(packed)[None]
            runs = {}
            for impl in ("sdpa", "cubeattn"):
                model.load_state_dict(init)
                model.set_attn_implementation(impl)
                model.train()
                runs[impl] = _train(torch, model, ids, pos, steps)
            for impl, (losses, ms) in runs.items():
                t = sorted(ms[warm:])
                row = dict(what="hf_train", impl=impl, B=1, S=s, sequences=packed, layers=cfg.num_hidden_layers,
                           heads=f"{cfg.num_attention_heads}/{cfg.num_key_value_heads}", steps=steps,
                           ms=t[len(t) // 2], loss_first=losses[0], loss_last=losses[-1])
                if impl == "cubeattn":
                    row["max_loss_diff"] = max(abs(a - b) for a, b in zip(losses, runs["sdpa"][0]))
                rows.append(row)
        del model, init
        torch.cuda.empty_cache()
    return rows
