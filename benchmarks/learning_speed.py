"""Which configuration learns fastest per wall-second, and how it compares with TRL's GRPOTrainer.

For each seed, one SFT warm-start (the default run's start) is built once; then the lanes
(`--pair A B`, or any number with `--lanes`) run side by side from it, one CPU thread each,
each in its own process, so machine load falls on all equally (`--parallel-seeds`: every
seed's lanes at once, on a machine with a core per lane). A lane trains until its training clock reaches `--seconds`; greedy
validation on the held-out split runs after every rollout round (ours) or generation batch
(TRL), with the clock paused, so both lanes are judged on the same val set at the same
training time, and the curve also gives accuracy at equal sample counts.

Lanes: `LANES` (project configurations as overrides of the defaults) and `trl` (TRL's
GRPOTrainer with the same prompts, rule reward, responses per prompt, prompts per
generation, response length and learning rate; its other settings are TRL's defaults, as a
user would try it). TRL is imported from `--trl-site` (a `pip install --target` folder) only
in its own lane.

    python benchmarks/learning_speed.py --pair default grpo --seeds 0 1 2 --seconds 300
    python benchmarks/learning_speed.py --lanes default e1 trl --seeds 0 1 2 --parallel-seeds --eval-every 30

Writes benchmarks/results/learning_speed_<a>_vs_<b>.json (machine, versions, command, curves).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics as st
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Project configurations, as overrides of the library defaults.
LANES: dict[str, list[str]] = {
    "default": [],
    "gae_t1": ["rollout.temperature=1.0"],
    "grpo": ["algorithm.adv_estimator=grpo"],  # here GRPO's advantages ignore the in-reward KL: no KL term
    # verl's GRPO recipe: the KL to the reference as a loss term instead of in the reward
    "grpo_klloss": ["algorithm.adv_estimator=grpo", "actor.use_kl_loss=true", "algorithm.use_kl_in_reward=false"],
    "grpo_t1": ["algorithm.adv_estimator=grpo", "rollout.temperature=1.0"],
    "grpo_lr5e-4": ["algorithm.adv_estimator=grpo", "actor.lr=5e-4"],
    "grpo_t1_lr5e-4": ["algorithm.adv_estimator=grpo", "rollout.temperature=1.0", "actor.lr=5e-4"],
    "grpo_e1": ["algorithm.adv_estimator=grpo", "actor.ppo_epochs=1"],
    "grpo_n8_b32": ["algorithm.adv_estimator=grpo", "rollout.n=8", "data.train_batch_size=32",
                    "actor.ppo_mini_batch_size=8"],
    "grpo_lr1e-3": ["algorithm.adv_estimator=grpo", "actor.lr=1e-3"],
    # one pass over each batch (as TRL's default): half the update's cost per sample
    "e1": ["actor.ppo_epochs=1", "critic.ppo_epochs=1"],
    "e2": ["actor.ppo_epochs=2", "critic.ppo_epochs=2"],  # two passes over each batch
    "e1_lr4e-4": ["actor.ppo_epochs=1", "critic.ppo_epochs=1", "actor.lr=4e-4"],
    "rloo_e1": ["algorithm.adv_estimator=rloo", "actor.ppo_epochs=1"],
    "grpo_klloss_e1": ["algorithm.adv_estimator=grpo", "actor.use_kl_loss=true", "algorithm.use_kl_in_reward=false",
                       "actor.ppo_epochs=1"],
}
TRL_SITE = "/work/main/.cache/trl-site"
RUN_OVERRIDES = ["trainer.resume=disable", "trainer.logger=[none]", "trainer.total_rounds=100000",
                 "trainer.test_freq=100000", "trainer.val_before_train=false", "trainer.num_threads=1",
                 "trainer.save_freq=-1"]


def lane_config(lane: str, seed: int, out_dir: Path, overrides: list[str]):
    from rlhf.config import load_config

    extra = LANES.get(lane, [])
    return load_config(None, [f"trainer.seed={seed}", f"trainer.output_dir={out_dir}", *RUN_OVERRIDES, *extra,
                              *overrides])


def val_accuracy(model, tok, cfg, val) -> float:
    """Greedy accuracy on the held-out split, the model left as it was found (train/eval)."""
    from rlhf.round.evaluate import evaluate_greedy
    from rlhf.rollout.hf import HFRolloutEngine

    was_training = model.training
    model.eval()
    acc = evaluate_greedy(HFRolloutEngine(model, tok, batch_size=256), tok, val, cfg.data.max_prompt_length,
                          cfg.data.max_response_length, cfg.reward)["val/accuracy"]
    model.train(was_training)
    return acc


def due(clock: float, seconds: float, every: float, last_eval: float) -> bool:
    """Validate now? After every round with `every` 0, else once per `every` seconds of
    training clock, and at the end."""
    return every <= 0 or clock >= seconds or clock // every > last_eval // every


def our_lane(lane: str, seed: int, out_dir: str, seconds: float, overrides: list[str], go, result,
             every: float = 0.0) -> None:
    """Child: the project's rounds (rlhf.train's Run) until the training clock reaches `seconds`."""
    import torch

    torch.set_num_threads(1)
    from rlhf.train import Run

    cfg = lane_config(lane, seed, Path(out_dir), overrides)
    run = Run(cfg)
    per_round = cfg.trainer.steps_per_round * cfg.data.train_batch_size * cfg.rollout.n
    curve = [{"round": 0, "samples": 0, "clock_s": 0.0, "val": run.evaluate()}]
    go.wait()
    clock, reason = 0.0, ""
    while clock < seconds and not reason:
        t = time.perf_counter()
        _, verdict = run.round()
        clock += time.perf_counter() - t
        reason = verdict.reason if verdict.stop else ""
        if due(clock, seconds, every, curve[-1]["clock_s"]) or reason:
            curve.append({"round": run.state.round, "samples": run.state.round * per_round, "clock_s": clock,
                          "val": run.evaluate()})
    run.close()
    result.put({"lane": lane, "seed": seed, "curve": curve, "stop_reason": reason, "overrides": LANES.get(lane, []) + overrides})


def trl_lane(lane: str, seed: int, out_dir: str, seconds: float, overrides: list[str], go, result,
             every: float = 0.0, partner: str = "default", trl_site: str = TRL_SITE) -> None:
    """Child: TRL's GRPOTrainer from the same start on the same prompts and reward, with the
    prompts per generation, responses per prompt, response length and learning rate of the
    lane it is compared with (`partner`); everything else is TRL's default."""
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, trl_site)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlhf.round import stages
    from rlhf.models.load import load_tokenizer
    from rlhf.rewards import compute_scores

    cfg = lane_config(partner, seed, Path(out_dir), overrides)  # the compared lane's sizes and lr
    data = stages.prepare_data(cfg)
    base = str(Path(out_dir) / "base_model")
    tok = load_tokenizer(base)
    cols = ["prompt", "ground_truth", "data_source", "extra_info", "reward_style"]
    train = Dataset.from_pandas(data.train[cols].reset_index(drop=True))

    def rule_reward(completions, ground_truth, data_source, extra_info, reward_style, **_):
        extra = [json.loads(x) if x else {} for x in extra_info]
        return compute_scores(data_source, completions, ground_truth, extra, reward_style, cfg.reward)

    prompts_per_gen, n = cfg.data.train_batch_size, cfg.rollout.n
    args = GRPOConfig(output_dir=str(Path(out_dir) / "trl"), per_device_train_batch_size=prompts_per_gen,
                      steps_per_generation=n, num_generations=n, max_completion_length=cfg.data.max_response_length,
                      learning_rate=cfg.actor.lr, lr_scheduler_type="constant", use_cpu=True, report_to="none",
                      save_strategy="no", logging_steps=10**6, disable_tqdm=True, max_steps=10**7, seed=seed,
                      dataloader_num_workers=0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    curve = [{"round": 0, "samples": 0, "clock_s": 0.0, "val": val_accuracy(model, tok, cfg, data.val)}]
    clock = Clock()

    class EvalAndStop(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            if state.global_step % args.steps_per_generation == 0:
                clock.pause()
                rnd = state.global_step // args.steps_per_generation
                if due(clock.total, seconds, every, curve[-1]["clock_s"]):
                    curve.append({"round": rnd, "samples": rnd * prompts_per_gen * n, "clock_s": clock.total,
                                  "val": val_accuracy(kw["model"], tok, cfg, data.val)})
                control.should_training_stop = clock.total >= seconds
                clock.resume()

    trainer = GRPOTrainer(model=model, reward_funcs=[rule_reward], args=args, train_dataset=train,
                          processing_class=tok, callbacks=[EvalAndStop()])
    go.wait()
    clock.resume()
    trainer.train()
    import trl

    result.put({"lane": lane, "seed": seed, "curve": curve, "stop_reason": "", "trl_version": trl.__version__,
                "trl_args": {k: getattr(args, k) for k in ("learning_rate", "beta", "loss_type", "scale_rewards",
                                                          "num_iterations", "epsilon", "temperature",
                                                          "per_device_train_batch_size", "steps_per_generation",
                                                          "num_generations", "max_completion_length")}})


class Clock:
    """A stopwatch that can pause (validation is not training time)."""

    def __init__(self):
        self.total, self._since = 0.0, None

    def resume(self):
        self._since = time.perf_counter()

    def pause(self):
        self.total += time.perf_counter() - self._since
        self._since = None


def warm_start(seed: int, root: Path, overrides: list[str]) -> Path:
    """The default run's SFT warm-start for `seed`, built once under `root`."""
    import torch

    from rlhf.round import stages
    from rlhf.round.policy import prepare_policy

    cfg = lane_config("default", seed, root, overrides)
    torch.set_num_threads(1)
    torch.manual_seed(seed)  # as rlhf.train does before it builds the policy
    return Path(prepare_policy(cfg, str(root), stages.prepare_data(cfg)))


def run_group(seeds: list[int], lanes: list[str], args) -> list[dict]:
    """Every lane of every seed in `seeds` side by side (one process and thread each), each
    seed's lanes from that seed's warm-start; their results in seed, then lane order."""
    ctx = mp.get_context("spawn")
    go, results, procs = ctx.Event(), ctx.Queue(), []
    partner = "default" if "default" in lanes else next((x for x in lanes if x != "trl"), "default")
    for seed in seeds:
        root = Path(args.out) / f"seed{seed}"
        base = warm_start(seed, root, args.overrides)
        for lane in lanes:
            lane_dir = root / lane
            lane_dir.mkdir(parents=True, exist_ok=True)
            link = lane_dir / "base_model"
            if not link.exists():
                link.symlink_to(base.resolve(), target_is_directory=True)
            lane_args = (lane, seed, str(lane_dir), args.seconds, args.overrides, go, results, args.eval_every)
            if lane == "trl":
                procs.append(ctx.Process(target=trl_lane, args=lane_args + (partner, args.trl_site)))
            else:
                procs.append(ctx.Process(target=our_lane, args=lane_args))
    for p in procs:
        p.start()
    time.sleep(args.settle)  # every lane finishes start-up (imports, model load) before any clock starts
    go.set()
    rows = {}
    for _ in procs:
        r = results.get(timeout=args.seconds * 4 + 1200)
        rows[(r["seed"], r["lane"])] = r
        done = Path(args.out) / "rows"
        done.mkdir(parents=True, exist_ok=True)
        (done / f"{r['seed']}_{r['lane']}.json").write_text(json.dumps(r))  # kept if the run is cut short
        print(f"seed {r['seed']} {r['lane']}: {r['curve'][0]['val']:.3f} -> {r['curve'][-1]['val']:.3f} "
              f"in {r['curve'][-1]['clock_s']:.0f}s, {r['curve'][-1]['samples']} samples", flush=True)
    for p in procs:
        p.join(timeout=120)
    return [rows[(seed, lane)] for seed in seeds for lane in lanes]


def link_start(seed: int, args) -> None:
    """Use an already built warm-start for `seed` (the same function, seed and settings) if given."""
    if not args.start_from:
        return
    found = sorted(Path(args.start_from).glob(f"*_{seed}_t1"))
    base = Path(args.out) / f"seed{seed}" / "base_model"
    if found and not base.exists():
        base.parent.mkdir(parents=True, exist_ok=True)
        base.symlink_to(found[0].resolve(), target_is_directory=True)


def merge(args) -> None:
    """One result from several runs of the same pair (their commands kept)."""
    parts = [json.loads(Path(f).read_text()) for f in args.merge]
    if any(p["pair"] != args.pair for p in parts):
        raise SystemExit(f"--merge: every file must hold the pair {args.pair}")
    rows = [r for p in parts for r in p["runs"]]
    result = dict(parts[0], command=[p["command"] for p in parts], wall_s=sum(p["wall_s"] for p in parts),
                  summary=summarize(rows, args.pair), runs=rows)
    out = Path(args.result or ROOT / "benchmarks" / "results" / f"learning_speed_{args.pair[0]}_vs_{args.pair[1]}.json")
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result["summary"], indent=2))


def at_samples(curve: list[dict], samples: int) -> float:
    """Val accuracy at the first point with at least `samples` samples (the last point if none)."""
    return next((c["val"] for c in curve if c["samples"] >= samples), curve[-1]["val"])


def mean_gain_over_time(curve: list[dict]) -> float:
    """Time-average of (val - start) over the training clock, val held between evaluations:
    rewards learning early as well as ending high, and is less noisy than the last point."""
    area = sum((b["clock_s"] - a["clock_s"]) * a["val"] for a, b in zip(curve, curve[1:]))
    return area / curve[-1]["clock_s"] - curve[0]["val"]


def summarize(rows: list[dict], pair: list[str]) -> dict:
    out = {}
    for lane in pair:
        mine = [r for r in rows if r["lane"] == lane]
        gains = [r["curve"][-1]["val"] - r["curve"][0]["val"] for r in mine]
        last3 = [st.mean(c["val"] for c in r["curve"][-3:]) - r["curve"][0]["val"] for r in mine]
        over_time = [mean_gain_over_time(r["curve"]) for r in mine]
        out[lane] = {"mean_gain_at_wall": st.mean(gains), "gains": gains,
                     "mean_gain_last3_evals": st.mean(last3), "gain_last3_evals": last3,
                     "mean_gain_over_time": st.mean(over_time), "gain_over_time": over_time,
                     "start": [r["curve"][0]["val"] for r in mine], "end": [r["curve"][-1]["val"] for r in mine],
                     "samples_at_wall": [r["curve"][-1]["samples"] for r in mine],
                     "clock_s": [r["curve"][-1]["clock_s"] for r in mine]}
    # Equal samples: each seed at the sample count the slowest lane reached.
    for seed in sorted({r["seed"] for r in rows}):
        mine = [next(r for r in rows if r["seed"] == seed and r["lane"] == lane) for lane in pair]
        common = min(r["curve"][-1]["samples"] for r in mine)
        for lane, r in zip(pair, mine):
            out[lane].setdefault("gain_at_equal_samples", []).append(at_samples(r["curve"], common)
                                                                      - r["curve"][0]["val"])
        out.setdefault("equal_samples", []).append(common)
    for lane in pair:
        out[lane]["mean_gain_at_equal_samples"] = st.mean(out[lane]["gain_at_equal_samples"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pair", nargs=2, default=None, help=f"two lanes from {sorted(LANES)} or trl")
    p.add_argument("--lanes", nargs="+", default=None, help="any number of lanes (instead of --pair)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--parallel-seeds", action="store_true",
                   help="run every seed's lanes at once (one core per lane: lanes x seeds cores)")
    p.add_argument("--seconds", type=float, default=300.0, help="training clock per lane (validation excluded)")
    p.add_argument("--eval-every", type=float, default=0.0,
                   help="validate once per this many seconds of training clock (0: after every round)")
    p.add_argument("--settle", type=float, default=45.0, help="seconds for every lane's start-up before the clocks")
    p.add_argument("--out", default=str(ROOT / "outputs" / "bench_learning_speed"))
    p.add_argument("--result", default="")
    p.add_argument("--trl-site", default=TRL_SITE, help="a `pip install --target` folder holding TRL")
    p.add_argument("overrides", nargs="*", help="overrides for every lane (after each lane's own)")
    p.add_argument("--merge", nargs="+", default=[], metavar="JSON",
                   help="combine earlier results of this pair (e.g. one file per seed) into --result")
    p.add_argument("--start-from", default="",
                   help="DIR with one warm-started policy per seed as DIR/*_<seed>_t1 (sft_reliability.py --save-dir)")
    args = p.parse_args()
    lanes = args.lanes or args.pair
    if not lanes or (args.lanes and args.pair):
        raise SystemExit("give --pair A B or --lanes A B C ...")
    args.pair = lanes
    if args.merge:
        return merge(args)
    for lane in lanes:
        if lane != "trl" and lane not in LANES:
            raise SystemExit(f"unknown lane {lane!r}; choose from {sorted(LANES)} or trl")
    t0 = time.perf_counter()
    rows = []
    for seed in args.seeds:
        link_start(seed, args)
    for group in ([args.seeds] if args.parallel_seeds else [[s] for s in args.seeds]):
        rows += run_group(group, lanes, args)
    import torch
    import transformers

    result = {"benchmark": "learning_speed", "pair": lanes, "command": " ".join(["python"] + sys.argv),
              "wall_s": time.perf_counter() - t0, "seconds_per_lane": args.seconds, "eval_every_s": args.eval_every,
              "method": "per seed: one SFT warm-start; the lanes side by side (one process, one thread each; "
                        + ("every seed at once" if args.parallel_seeds else "one seed at a time")
                        + ") from it, each until its training clock (validation paused) reaches seconds_per_lane; "
                        "greedy val accuracy on the held-out split "
                        + (f"once per {args.eval_every:g} s of training clock and at the end" if args.eval_every
                           else "after every round"),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                          "cpu": cpu_name(), "torch": torch.__version__, "transformers": transformers.__version__},
              "lanes": {lane: LANES.get(lane, "TRL GRPOTrainer") for lane in lanes}, "overrides": args.overrides,
              "summary": summarize(rows, lanes), "runs": rows}
    out = Path(args.result or ROOT / "benchmarks" / "results" / f"learning_speed_{'_vs_'.join(lanes)}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: {m: v[m] for m in ("mean_gain_at_wall", "gains", "mean_gain_over_time", "samples_at_wall")}
                      for k, v in result["summary"].items() if k in lanes}, indent=1))


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
