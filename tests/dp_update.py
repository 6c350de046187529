"""One PPO update on a fixed, deterministic scored buffer; run alone or under torchrun.

    python tests/dp_update.py OUT [key=value ...]   # config overrides after the folder

Writes `<out>/rank<k>.json` with the step's losses, a weight checksum and the buffer rows
the rank trained on (in its order), so a test can compare 1 process against 2 ranks on the
same global batch.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import torch


def scored_buffer(tokenizer, n_prompts: int, n: int, resp_len: int) -> pd.DataFrame:
    """Prompts from the arithmetic task; fixed-length random responses; random 0/1 scores;
    `row`: the row's position in the buffer."""
    from rlhf.data.arithmetic import make_arithmetic
    from schemas import dump_json_column

    g = torch.Generator().manual_seed(7)
    prompts = make_arithmetic(n_prompts, seed=3)
    rows = prompts.loc[prompts.index.repeat(n)].reset_index(drop=True)
    p_ids = [tokenizer(p)["input_ids"] for p in rows["prompt"]]
    vocab = [i for i in range(len(tokenizer)) if i not in tokenizer.all_special_ids]
    r_ids = [[vocab[int(j)] for j in torch.randint(len(vocab), (resp_len,), generator=g)] for _ in range(len(rows))]
    scores = torch.randint(0, 2, (len(rows),), generator=g).double().numpy()
    return rows.assign(
        response=[tokenizer.decode(r) for r in r_ids], prompt_ids=dump_json_column(p_ids),
        response_ids=dump_json_column(r_ids), group_id=np.repeat(np.arange(n_prompts), n).astype(np.int64),
        rollout_logprobs=["[]"] * len(rows), finish_reason=["length"] * len(rows), score=scores,
        row=np.arange(len(rows)))


def main(out: str, overrides: list[str]) -> None:
    from rlhf.round import stages
    from rlhf.config import derive_sizes, load_config
    from rlhf.trainer.default_policy import build_tiny_policy
    from rlhf.models.load import ValueModel
    from rlhf.trainer import dist as D
    from rlhf.trainer.ppo import PPOTrainer

    torch.set_num_threads(1)
    device = torch.device("cpu")
    rank, world = D.init_distributed(device)
    cfg = load_config(None, [
        "model.tiny.hidden_size=32", "model.tiny.num_hidden_layers=2", "model.tiny.num_attention_heads=2",
        "model.tiny.num_key_value_heads=2", "model.tiny.intermediate_size=64", "data.train_batch_size=8",
        "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=4", "rollout.n=2",
        "critic.ppo_micro_batch_size_per_gpu=4", "data.max_response_length=6", "actor.lr=1e-3",
        "critic.lr=1e-3", f"trainer.n_gpus_per_node={world}", "algorithm.kl_ctrl.kl_coef=0.05", *overrides])
    model, tok = build_tiny_policy(cfg)
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    critic = ValueModel(copy.deepcopy(model.model))
    start = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = PPOTrainer(cfg, derive_sizes(cfg, world), model, critic, ref, device)
    scored = scored_buffer(tok, cfg.data.train_batch_size, cfg.rollout.n, cfg.data.max_response_length)
    local = stages.shard_for_update(scored, cfg, rank, world)
    (metrics,) = stages.update(trainer, local, tok.pad_token_id, cfg)
    params = trainer.actor.module.state_dict()
    checksum = sum(float((v.double() * (i + 1)).sum()) for i, (k, v) in enumerate(sorted(params.items())))
    diff = max(float((params[k] - start[k]).abs().max()) for k in start)
    Path(out).mkdir(parents=True, exist_ok=True)
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "pg_loss": metrics["actor/pg_loss"], "vf_loss": metrics["critic/vf_loss"], "checksum": checksum,
        "max_param_diff_vs_start": diff, "world": world,
        "rows": local["row"].tolist()}))
    D.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
