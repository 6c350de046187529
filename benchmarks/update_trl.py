"""The TRL lane of benchmarks/update_throughput.py: TRL's GRPOTrainer step on the same model
and scored batch as this project's update, driven without generation."""

from __future__ import annotations

import tempfile

import torch

import gpu_common as G
from update_summary import summarize


def run_trl(a) -> dict:
    """TRL's GRPOTrainer on the same model and batch, driven without generation: the
    reference and old log-probs of `_generate_and_score_completions`, then per micro-batch
    `compute_loss` + `accelerator.backward`, with an optimizer step per mini-batch."""
    import trl
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rlhf.models.tokenizer import build_char_tokenizer

    device = G.pick_device(a.tiny)
    dtype = torch.float32 if a.tiny else torch.bfloat16
    tok = build_char_tokenizer()
    model_dir = tempfile.mkdtemp(prefix="trl-policy-")
    policy = G.build_policy(a.model, device, dtype)
    policy.config.pad_token_id = tok.pad_token_id
    policy.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    vocab = policy.config.vocab_size
    n_actor, n_embed = G.n_params(policy), policy.get_input_embeddings().weight.numel()
    del policy
    torch.cuda.empty_cache() if device.type == "cuda" else None

    rows = a.prompts * a.n
    micro, mini_rows = a.micro, a.mini * a.n
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-out-"), per_device_train_batch_size=micro,
        gradient_accumulation_steps=mini_rows // micro, steps_per_generation=rows // micro,
        num_generations=a.n, max_completion_length=a.max_response, beta=0.001, epsilon=0.2, learning_rate=1e-6,
        loss_type="bnpo", bf16=not a.tiny, use_cpu=device.type == "cpu", report_to="none",
        gradient_checkpointing=False, model_init_kwargs={"dtype": dtype}, save_strategy="no",
        logging_steps=10**6, max_grad_norm=1.0, disable_dropout=True, seed=a.seed)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=[_zero_reward], args=args,
                          train_dataset=Dataset.from_dict({"prompt": ["1+1="] * rows}), processing_class=tok)
    trainer.create_optimizer()
    model, optimizer = trainer.accelerator.prepare(trainer.model, trainer.optimizer)
    trainer.model_wrapped = model
    trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps
    model.train()

    p_lens, r_lens = G.sample_lengths(a.prompts, a.n, a.max_prompt, a.max_response, seed=a.seed)
    _, prompts, responses = G.scored_buffer(p_lens, r_lens, a.n, vocab, seed=a.seed)
    batch = trl_layout(prompts, responses, tok.pad_token_id, device)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    keep = batch["completion_ids"].shape[1]
    tokens = float(mask.sum())
    resp_tokens = float(batch["completion_mask"].sum())

    steps = []
    for it in range(a.warmup + a.steps):
        timer = G.StageTimer(device)
        with timer("total"):
            with torch.no_grad():
                with timer("old_log_prob"):
                    old, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, keep, batch_size=micro)
                with timer("ref"):
                    ref, _, _ = trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, mask, keep,
                                                                           batch_size=micro)
            inputs = dict(batch, old_per_token_logps=old, ref_per_token_logps=ref,
                          advantages=torch.randn(rows, device=device))
            with timer("update_actor"):
                for s in range(0, rows, mini_rows):
                    for m in range(s, s + mini_rows, micro):
                        part = {k: v[m:m + micro] for k, v in inputs.items()}
                        loss = trainer.compute_loss(model, part)
                        trainer.accelerator.backward(loss)
                    trainer.accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
        if it >= a.warmup:
            steps.append({"times_s": timer.times, "peak_gb": timer.peak_gb, "alloc_retries": timer.alloc_retries,
                          "pg_loss": float(loss.detach()), "vf_loss": None})
        print("[trl] step %d: " % it + " ".join(f"{k}={v:.2f}s" for k, v in timer.times.items()), flush=True)
    out = summarize(steps, tokens=tokens, resp_tokens=resp_tokens, world=1, n_actor=n_actor, n_critic=0,
                    n_embed=n_embed, peak=0 if a.tiny else G.PEAK_BF16_FLOPS)
    out.update(variant="trl", world_size=1, trl_version=trl.__version__, lengths=G.length_stats(p_lens, r_lens),
               trl_args={k: getattr(args, k) for k in ("per_device_train_batch_size", "gradient_accumulation_steps",
                                                       "steps_per_generation", "beta", "loss_type", "bf16",
                                                       "gradient_checkpointing", "optim", "max_grad_norm")},
               padded_tokens_per_step=float(mask.numel()), n_params_actor=n_actor, epochs=1,
               optimizer=type(getattr(optimizer, "optimizer", optimizer)).__name__)
    if device.type == "cuda":
        out["peak_gb_process"] = torch.cuda.max_memory_reserved(device) / 2**30
    return out


def _zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def trl_layout(prompts: list[list[int]], responses: list[list[int]], pad_id: int, device) -> dict:
    """TRL's batch layout: prompts left-padded and completions right-padded to the batch's widths."""
    P, R = max(map(len, prompts)), max(map(len, responses))
    out = {"prompt_ids": torch.full((len(prompts), P), pad_id), "prompt_mask": torch.zeros(len(prompts), P),
           "completion_ids": torch.full((len(prompts), R), pad_id), "completion_mask": torch.zeros(len(prompts), R)}
    for i, (p, r) in enumerate(zip(prompts, responses)):
        out["prompt_ids"][i, P - len(p):] = torch.tensor(p)
        out["prompt_mask"][i, P - len(p):] = 1
        out["completion_ids"][i, :len(r)] = torch.tensor(r)
        out["completion_mask"][i, :len(r)] = 1
    out["prompt_mask"] = out["prompt_mask"].long()
    out["completion_mask"] = out["completion_mask"].long()
    return {k: v.to(device) for k, v in out.items()}
