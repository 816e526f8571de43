"""A Hugging Face causal-LM loop as DeepSpeed users write one (the shape of transformers'
run_clm_no_trainer.py with DeepSpeed): the `no_decay` parameter-group split, a client AdamW and a
client LambdaLR warm-up, a DeepSpeed config given as a dict, `training_data` with a `collate_fn`,
and `model_engine(**batch).loss`, `backward`, `step`. The only change from the DeepSpeed original is
the import line. A tiny GPT-2 built from a config (nothing is downloaded).
"""
import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

import megazero as deepspeed

VOCAB, SEQ, SAMPLES = 101, 16, 64


def build_model():
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def dataset():
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=torch.Generator().manual_seed(3))
    return [{"input_ids": t} for t in tokens]


def collate(samples):
    ids = torch.stack([s["input_ids"] for s in samples])
    return {"input_ids": ids, "labels": ids.clone()}


def param_groups(model, weight_decay):
    no_decay = ["bias", "ln_1.weight", "ln_2.weight", "ln_f.weight"]
    return [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]


def warmup(step, steps=4):
    return min(1.0, (step + 1) / steps)


def main(ds_config, steps=6):
    deepspeed.init_distributed()
    model = build_model()
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=3e-3, betas=(0.9, 0.95))
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup)
    model_engine, optimizer, train_loader, lr_scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, training_data=dataset(), collate_fn=collate,
        config=ds_config)
    losses, step_loss = [], 0.0
    gas = model_engine.gradient_accumulation_steps()
    for i, batch in enumerate(train_loader):
        batch = {k: v.to(model_engine.device) for k, v in batch.items()}
        loss = model_engine(**batch).loss
        model_engine.backward(loss)
        model_engine.step()
        step_loss += loss.item() / gas
        if model_engine.global_steps > len(losses):
            t = torch.tensor([step_loss])
            dist.all_reduce(t)
            losses.append(t.item() / dist.get_world_size())
            step_loss = 0.0
            if len(losses) == steps:
                break
    model_engine.eval()
    with torch.no_grad():
        logits = model_engine(input_ids=dataset()[0]["input_ids"][None].to(model_engine.device)).logits
    return {"losses": losses, "logits": logits[0, :4].tolist(), "lr": model_engine.get_lr()}
