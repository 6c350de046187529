"""A ZeRO-3 checkpoint written and restored by 2 gloo ranks (run under torchrun).

    python -m torch.distributed.run --nproc_per_node=2 tests/zero3_checkpoint.py OUT [ZERO_STAGE=3]

One update on a fixed buffer, a checkpoint (background writer), a second trainer built from
that checkpoint's safetensors with its optimizer state restored, and one more update on
both. Writes `<out>/rank<k>.json`: whether the saved actor and critic equal the gathered
weights, the largest difference after restore, and after the next update on both trainers
(rank 0, which holds the gathered weights).
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch


def gathered(engine) -> dict[str, torch.Tensor]:
    from rlhf.trainer.engines import full_state_dict

    sd = full_state_dict(engine)  # a collective; ZeRO-3 gathers onto rank 0 only
    return {k: v.detach().float().cpu().clone() for k, v in (sd or {}).items()}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:5]
    return max((float((a[k] - b[k]).abs().max()) for k in a), default=0.0)


def main(out: str, stage: int = 3) -> None:
    from dp_update import scored_buffer
    from safetensors.torch import load_file

    from rlhf.checkpoint import rounds as ckpt
    from rlhf.round import stages
    from rlhf.checkpoint.writer import CheckpointWriter
    from rlhf.config import derive_sizes, load_config
    from rlhf.trainer.default_policy import build_tiny_policy
    from rlhf.models.load import ValueModel, load_causal_lm
    from rlhf.round.state import RoundState
    from rlhf.trainer import dist as D
    from rlhf.trainer.ppo import PPOTrainer

    torch.set_num_threads(1)
    device = torch.device("cpu")
    rank, world = D.init_distributed(device)
    cfg = load_config(None, [
        "model.tiny.hidden_size=32", "model.tiny.num_hidden_layers=2", "model.tiny.num_attention_heads=2",
        "model.tiny.num_key_value_heads=2", "model.tiny.intermediate_size=64", "data.train_batch_size=8",
        "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=4", "rollout.n=2",
        "critic.ppo_micro_batch_size_per_gpu=4", "data.max_response_length=6", "actor.lr=1e-2", "critic.lr=1e-2",
        f"trainer.n_gpus_per_node={world}", f"deepspeed.zero_stage={stage}", "trainer.device=cpu"])
    model, tok = build_tiny_policy(cfg)
    ref = copy.deepcopy(model).eval().requires_grad_(False)
    sizes = derive_sizes(cfg, world)
    trainer = PPOTrainer(cfg, sizes, model, ValueModel(copy.deepcopy(model.model)), copy.deepcopy(ref), device)
    scored = scored_buffer(tok, cfg.data.train_batch_size, cfg.rollout.n, cfg.data.max_response_length)
    local = stages.shard_for_update(scored, cfg, rank, world)
    stages.update(trainer, local, tok.pad_token_id, cfg)
    actor_live, critic_live = gathered(trainer.actor), gathered(trainer.critic)
    path = Path(D.broadcast_object(str(Path(out) / "checkpoints" / "round_000001")))
    writer = CheckpointWriter()
    ckpt.save(path, trainer, tok, cfg, RoundState(round=1, global_step=1, kl_coef=trainer.kl_ctrl.value),
              writer=writer)
    writer.close()
    D.barrier()
    saved_critic = {f"backbone.{k}": v.float() for k, v in load_file(str(path / "critic" / ckpt.WEIGHTS_FILE)).items()}
    saved_critic.update({f"value_head.{k}": v.float() for k, v in load_file(str(path / "critic" / "value_head.safetensors")).items()})
    saved_actor = {k: v.float() for k, v in load_file(str(path / "actor" / ckpt.WEIGHTS_FILE)).items()}
    restored = PPOTrainer(cfg, sizes, load_causal_lm(str(path / "actor")), ValueModel.from_pretrained(str(path / "critic")),
                          ref, device)
    ckpt.restore(restored, path)
    after_restore = max(max_diff(gathered(restored.actor), actor_live), max_diff(gathered(restored.critic), critic_live))
    torch.manual_seed(1)
    stages.update(trainer, local, tok.pad_token_id, cfg)
    torch.manual_seed(1)
    stages.update(restored, local, tok.pad_token_id, cfg)
    next_actor = max_diff(gathered(restored.actor), gathered(trainer.actor))
    next_critic = max_diff(gathered(restored.critic), gathered(trainer.critic))
    moved = max_diff(gathered(trainer.actor), actor_live)
    result = {"world": world, "after_restore": after_restore, "next_update_actor": next_actor,
              "next_update_critic": next_critic, "next_update_moved": moved, "complete": ckpt.is_complete(path)}
    if rank == 0:
        lm_tied = {k: v for k, v in actor_live.items() if k != "lm_head.weight"}
        result["saved_actor_vs_live"] = max_diff(saved_actor, lm_tied)
        result["saved_critic_vs_live"] = max_diff(saved_critic, critic_live)
        result["critic_numel"] = sum(v.numel() for v in saved_critic.values())
        result["critic_live_numel"] = sum(v.numel() for v in critic_live.values())
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    D.shutdown()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main(sys.argv[1], *map(int, sys.argv[2:]))
