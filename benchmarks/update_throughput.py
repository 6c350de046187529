"""PPO update throughput on one GPU (or ranks under torchrun): ours against TRL's GRPO step.

Every variant runs in its own process (fresh memory, its own peak) on the same synthetic
scored batch: `train_batch_size` prompts x `rollout.n` responses with a realistic length
spread (gpu_common.sample_lengths), actor + critic + frozen reference.
Under torchrun each rank takes its share as the trainer does (`trainer.balance_batch`);
`rank_split` records the tokens per rank of each mini-batch, split contiguously and balanced.

Variants (ours: `rlhf.trainer.ppo.PPOTrainer` stage by stage, exactly the calls of `round`):
  padded       fixed micro-batches of rows, padded (trimmed to the micro-batch's longest row)
  packed       sequence packing + dynamic batch size (token budget per micro-batch)
  packed_ckpt  the same with activation checkpointing
  grpo_packed  no critic, GRPO advantages, KL loss (the work of TRL's GRPO step)
  check        log-probs and gradients of the fast paths against the model's own forward
  raw_bf16     control: the actor update in plain PyTorch, no DeepSpeed (update_diagnostics)
  raw_master   the same with float32 master weights
  trl          TRL's GRPOTrainer step on the same model and batch: reference and old
               log-probs, then compute_loss + backward + optimizer step per micro-batch

    python benchmarks/update_throughput.py --variants padded,packed,trl --out benchmarks/results/x.json
    python benchmarks/update_throughput.py --tiny --variants padded,packed   # CPU-sized check
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402

import gpu_common as G  # noqa: E402
from update_summary import summarize  # noqa: E402

OURS = {
    "padded": ["data.use_sequence_packing=false", "actor.use_dynamic_bsz=false"],
    "packed": ["data.use_sequence_packing=true", "actor.use_dynamic_bsz=true"],
    "packed_ckpt": ["data.use_sequence_packing=true", "actor.use_dynamic_bsz=true",
                    "model.enable_gradient_checkpointing=true"],
    "grpo_packed": ["data.use_sequence_packing=true", "actor.use_dynamic_bsz=true", "algorithm.adv_estimator=grpo",
                    "actor.use_kl_loss=true", "algorithm.use_kl_in_reward=false"],
    "grpo_padded": ["data.use_sequence_packing=false", "actor.use_dynamic_bsz=false",
                    "algorithm.adv_estimator=grpo", "actor.use_kl_loss=true", "algorithm.use_kl_in_reward=false"],
}


def base_overrides(a, world: int) -> list[str]:
    return [
        f"data.train_batch_size={a.prompts}", f"rollout.n={a.n}", f"data.max_prompt_length={a.max_prompt}",
        f"data.max_response_length={a.max_response}", f"actor.ppo_mini_batch_size={a.mini}",
        f"actor.ppo_micro_batch_size_per_gpu={a.micro}", f"critic.ppo_micro_batch_size_per_gpu={a.micro}",
        f"actor.ppo_max_token_len_per_gpu={a.max_tokens}", "model.dtype=bfloat16",
        f"actor.ppo_epochs={a.epochs}", f"critic.ppo_epochs={a.epochs}",
        f"deepspeed.bf16={'false' if a.tiny else 'true'}", f"deepspeed.zero_stage={a.zero}",
        "trainer.logger=[none]", f"trainer.n_gpus_per_node={world}", "algorithm.kl_ctrl.kl_coef=0.001",
        "actor.clip_ratio=0.2", "actor.lr=1e-6", "critic.lr=1e-5",
    ] + list(a.override)


# ---------------------------------------------------------------------------------------------
# Ours
# ---------------------------------------------------------------------------------------------


def run_ours(a, variant: str) -> dict:
    from rlhf.round import stages
    from rlhf.config import derive_sizes, load_config
    from rlhf.trainer import dist as D
    from rlhf.trainer.engines import prepare_module
    from rlhf.models.attention import use_varlen_attention
    from rlhf.trainer.ppo import PPOTrainer

    device = G.pick_device(a.tiny)
    G.init_process_group(device)
    rank, world = D.init_distributed(device)
    cfg = load_config(None, base_overrides(a, world) + OURS[variant])
    if a.ds_json:
        merge_ds_config(json.loads(a.ds_json))
    if a.ds_bf16_wrapper:  # DeepSpeed's own bf16 optimizer wrapper at stage 0, for comparison
        import rlhf.trainer.engines as E

        E.OWN_MASTER_WEIGHTS = False
    sizes = derive_sizes(cfg, world)
    dtype = torch.float32 if a.tiny else torch.bfloat16
    actor, critic, ref = G.build_models(a.model, device, dtype, with_critic=cfg.algorithm.adv_estimator == "gae")
    prepare_module(actor, cfg)
    if critic is not None:
        prepare_module(critic, cfg)
    if cfg.data.use_sequence_packing:
        use_varlen_attention(ref)
    n_actor, n_critic = G.n_params(actor), (G.n_params(critic) if critic is not None else 0)
    n_embed = actor.get_input_embeddings().weight.numel()
    trainer = PPOTrainer(cfg, sizes, actor, critic, ref, device)

    p_lens, r_lens = G.sample_lengths(a.prompts, a.n, a.max_prompt, a.max_response, seed=a.seed)
    full, _, _ = G.scored_buffer(p_lens, r_lens, a.n, actor.config.vocab_size, seed=a.seed)
    import pandas as pd  # the rank's share exactly as `stages.update` takes it

    rows = pd.DataFrame({"i": range(len(full)), "group_id": full.group_ids.tolist()})
    lengths = full.seq_lengths()
    local_rows = stages.shard_for_update(rows, cfg, rank, world, lengths=lengths)["i"].tolist()
    buf = full.select(local_rows).to(device)
    tokens_local = float(buf.attention_mask.sum())
    resp_tokens_local = float(buf.response_mask.sum())

    steps = []
    for it in range(a.warmup + a.steps):
        timer, m = one_step(trainer, buf, device)
        if it >= a.warmup:
            steps.append({"times_s": timer.times, "peak_gb": timer.peak_gb, "alloc_retries": timer.alloc_retries,
                          "pg_loss": m.get("actor/pg_loss"), "vf_loss": m.get("critic/vf_loss"),
                          "skipped": trainer.skipped_steps})
        if rank == 0:
            print(f"[{variant}] step {it}: " + " ".join(f"{k}={v:.2f}s" for k, v in timer.times.items()), flush=True)
    profile = profile_step(a, variant, trainer, buf, device, rank) if a.profile_dir else None
    tot = D.all_reduce_sum(torch.tensor([tokens_local, resp_tokens_local], dtype=torch.float64)).tolist()
    out = summarize(steps, tokens=tot[0], resp_tokens=tot[1], world=world, n_actor=n_actor, n_critic=n_critic,
                    n_embed=n_embed, peak=0 if a.tiny else G.PEAK_BF16_FLOPS, epochs=a.epochs)
    out.update(variant=variant, world_size=world, config_overrides=base_overrides(a, world) + OURS[variant],
               sizes=sizes.__dict__, n_params_actor=n_actor, n_params_critic=n_critic,
               lengths=G.length_stats(p_lens, r_lens), ds_config_extra=json.loads(a.ds_json or "{}"),
               optimizer=type(trainer.actor.optimizer).__name__,
               profile=profile, **rank_split(cfg, rows, lengths, world))
    if device.type == "cuda":
        out["peak_gb_process"] = torch.cuda.max_memory_reserved(device) / 2**30
        peaks = D.all_gather_cat(torch.tensor([out["peak_gb_process"]], device=device)).tolist()
        out["peak_gb_reserved_per_rank"] = peaks
    return out if rank == 0 else {}


def rank_split(cfg, rows, lengths: list[int], world: int) -> dict:
    """Tokens per rank of each mini-batch under the contiguous and the balanced split
    (`trainer.balance_batch`), for this run's ranks (2 when it runs alone: what two would
    get); `rank_token_imbalance` is the worst mini-batch's heaviest rank over the mean."""
    import dataclasses

    from rlhf.round import stages
    from rlhf.config import derive_sizes

    w = max(world, 2)
    on = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, balance_batch=True))
    m = derive_sizes(cfg, w).mini_batch_per_gpu
    split = {"contiguous": [stages.shard(rows, cfg.trainer.steps_per_round, r, w)["i"].tolist() for r in range(w)],
             "balanced": [stages.shard_for_update(rows, on, r, w, lengths=lengths)["i"].tolist() for r in range(w)]}
    stats = {}
    for name, parts in split.items():
        tokens = [[sum(lengths[i] for i in p[k:k + m]) for p in parts] for k in range(0, len(parts[0]), m)]
        stats[name] = {"rank_token_imbalance": stages.rank_token_imbalance(lengths, parts, m),
                       "tokens_per_rank_per_mini_batch": tokens}
    return {"rank_split": {"world_size": w, "balance_batch": cfg.trainer.balance_batch, **stats},
            "rank_token_imbalance": {k: v["rank_token_imbalance"] for k, v in stats.items()}}


def one_step(trainer, buf, device):
    """The stages of one PPO step, exactly the calls of `PPOTrainer.round`, each timed."""
    timer = G.StageTimer(device)
    with timer("total"):
        with timer("old_log_prob"):
            b = trainer.behaviour_log_probs(buf)
        with timer("ref"):
            b = trainer.reference_log_probs(b)
        with timer("values"):
            b = trainer.critic_values(b)
        with timer("adv"), torch.device(device):  # scalars it builds with torch.tensor go to the device
            b, m = trainer.advantages(b)
        with timer("update_critic"):
            m.update(trainer.update_critic(b))
        with timer("update_actor"):
            m.update(trainer.update_actor(b))
    return timer, m


def profile_step(a, variant: str, trainer, buf, device, rank: int) -> dict:
    """One more step under the `trainer.profile_steps` machinery (rlhf.tracking.profiling), its trace
    read back into stage busy fractions and top kernels (trace_summary)."""
    import trace_summary

    from rlhf.tracking.profiling import StepProfiler
    from rlhf.trainer import dist as D

    rows = min(len(buf), a.profile_prompts * a.n // D.world()[1]) if a.profile_prompts else len(buf)
    prof = StepProfiler([1], Path(a.profile_dir) / variant, device, rank)
    with prof.update(1, 1) as out:
        timer, _ = one_step(trainer, buf.select(slice(0, rows)), device)
    name = "trace.json.gz" if rank == 0 else f"trace.rank{rank}.json.gz"
    summary = trace_summary.summarize(trace_summary.load(out / name))
    text = trace_summary.format_summary(summary)
    (out / "summary.txt").write_text(text)
    if rank == 0:
        print(text, flush=True)
    return {"dir": str(out), "profiled_rows": rows, "profiled_step_times_s": timer.times, **summary,
            "ranges_table": (out / "ranges.txt").read_text()}


def merge_ds_config(extra: dict) -> None:
    """Merge `extra` (nested keys) into every DeepSpeed config the trainer builds."""
    import rlhf.trainer.engines as E

    base = E.ds_config

    def merged(*args, **kw):
        out = base(*args, **kw)
        for k, v in extra.items():
            out[k] = {**out[k], **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        return out

    E.ds_config = merged


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="padded,packed,trl")
    p.add_argument("--variant", default="", help="run one variant in this process (used by the driver)")
    p.add_argument("--model", default="1.5b", choices=sorted(G.SHAPES))
    p.add_argument("--tiny", action="store_true", help="CPU-sized: tiny model, short sequences, fp32")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--rollout-n", dest="n", type=int, default=4, help="responses per prompt")
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--max-response", type=int, default=512)
    p.add_argument("--mini", type=int, default=16, help="actor.ppo_mini_batch_size, in prompts")
    p.add_argument("--micro", type=int, default=8, help="micro-batch rows of the padded paths and of TRL")
    p.add_argument("--max-tokens", type=int, default=16384, help="actor.ppo_max_token_len_per_gpu")
    p.add_argument("--zero", type=int, default=0)
    p.add_argument("--epochs", type=int, default=1,
                   help="actor/critic ppo_epochs: passes over each step's batch (TRL's GRPO step and verl: 1)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=int, default=900, help="seconds per variant process")
    p.add_argument("--override", action="append", default=[], help="extra config key=value for our variants")
    p.add_argument("--ds-json", default="", help="JSON merged into our engines' DeepSpeed configs")
    p.add_argument("--ds-bf16-wrapper", action="store_true",
                   help="bf16 at ZeRO 0 through DeepSpeed's unfused wrapper instead of MasterAdamW")
    p.add_argument("--profile-dir", default="", help="profile one more step of our variants; traces go here")
    p.add_argument("--profile-prompts", type=int, default=16,
                   help="prompts of the profiled step (one mini-batch keeps the trace small); 0 = all")
    p.add_argument("--out", default="benchmarks/results/update_throughput.json")
    a = p.parse_args(argv)
    if a.tiny:
        a.model = "tiny"
        a.max_prompt, a.max_response = min(a.max_prompt, 48), min(a.max_response, 48)
        a.prompts, a.mini, a.micro = min(a.prompts, 8), min(a.mini, 4), min(a.micro, 4)
        a.max_tokens = min(a.max_tokens, 256)
        a.steps, a.warmup = min(a.steps, 1), min(a.warmup, 1)
    return a


def run_one(a) -> None:
    try:
        if a.variant in ("check", "attn_check"):
            from update_checks import run_attn_check, run_check

            res = run_check(a) if a.variant == "check" else run_attn_check(a)
        elif a.variant.startswith("raw_"):
            from update_diagnostics import run_raw

            res = run_raw(a, a.variant)
        elif a.variant == "trl":
            from update_trl import run_trl  # TRL is imported only by its lane

            res = run_trl(a)
        else:
            res = run_ours(a, a.variant)
    except Exception as e:  # recorded, so that one failed variant does not hide the others
        res = {"variant": a.variant, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        print(res["traceback"], file=sys.stderr, flush=True)
    if res:
        res["env"] = G.environment(torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                                   else torch.device("cpu"))
        G.write_json(a.out, res)


def main(argv=None) -> None:
    a = parse(argv)
    if a.variant:
        return run_one(a)
    if not a.tiny and not torch.cuda.is_available():
        raise SystemExit("no GPU here: pass --tiny to run the CPU-sized version")
    results, t0 = {}, time.time()
    for v in [x for x in a.variants.split(",") if x]:
        out = Path(tempfile.mkdtemp()) / f"{v}.json"
        cmd = [sys.executable, __file__, "--variant", v, "--out", str(out)] + _without(argv or sys.argv[1:],
                                                                                       ("--variants", "--out"))
        t = time.time()
        try:
            proc = subprocess.run(cmd, timeout=a.timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        except subprocess.TimeoutExpired:
            proc = subprocess.CompletedProcess(cmd, returncode=f"timeout after {a.timeout} s")
        results[v] = json.loads(out.read_text()) if out.exists() else {"error": f"exit code {proc.returncode}"}
        results[v]["wall_s_with_setup"] = time.time() - t
        summary = compare(results)
        env = next((r["env"] for r in results.values() if "env" in r), {})
        G.write_json(a.out, {"benchmark": "update_throughput", "env": env, "model": a.model,
                             "batch": {"prompts": a.prompts, "n": a.n, "sequences": a.prompts * a.n,
                                       "max_prompt": a.max_prompt, "max_response": a.max_response},
                             "peak_bf16_flops": G.PEAK_BF16_FLOPS, "summary": summary, "variants": results,
                             "wall_s": time.time() - t0})
    print(json.dumps(summary, indent=1))


def _without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """`argv` minus the given flags and their values (`--f v` or `--f=v`)."""
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
        elif x in flags:
            skip = True
        elif not x.startswith(tuple(f + "=" for f in flags)):
            out.append(x)
    return out


def compare(results: dict) -> dict:
    """The ratios the targets are stated in, where both sides ran."""
    tps = {k: v.get("tokens_per_s") for k, v in results.items() if v.get("tokens_per_s")}
    out = {"tokens_per_s": tps, "mfu_actor": {k: v.get("mfu_actor") for k, v in results.items()},
           "rank_token_imbalance": {k: v["rank_token_imbalance"] for k, v in results.items()
                                    if "rank_token_imbalance" in v},
           "errors": {k: v["error"] for k, v in results.items() if "error" in v}}
    if "packed" in tps and "padded" in tps:
        out["packed_over_padded"] = tps["packed"] / tps["padded"]
    if "grpo_packed" in tps and "trl" in tps:
        out["ours_grpo_over_trl"] = tps["grpo_packed"] / tps["trl"]
    return out


if __name__ == "__main__":
    main()
