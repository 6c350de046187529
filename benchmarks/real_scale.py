"""Whole PPO rounds at real model size, through each driver's own functions, in one process.

    python benchmarks/real_scale.py --rounds 10 --drivers in_process --ckpt-dir /dev/shm/rs --one-checkpoint
    python benchmarks/real_scale.py --rounds 10 --drivers colocated --ckpt-dir /dev/shm/rs --one-checkpoint
    python benchmarks/real_scale.py --staged-rounds 2 --drivers staged --ckpt-dir /dev/shm/rs \
        --staged-alt-dir /tmp/rs                                                 # one device call each
    python benchmarks/real_scale.py --tiny --out /tmp/real_scale_tiny.json     # the same code on a CPU
    python benchmarks/real_scale.py --shape 7b --lora-rank 64 --rounds 10 --drivers in_process,colocated \
        --ckpt-dir /dev/shm/rs --out benchmarks/results/real_scale_7b_lora_h200.json   # LoRA, 7B shape
    python benchmarks/real_scale.py --rounds 10 --drivers in_process --rollout vllm ...  # vLLM in place of hf_fast

The workload: a Qwen2.5-1.5B-shaped actor and critic (random init, bf16), 64 prompts x 4
responses, prompts up to 512 tokens, responses up to 256, `hf_fast` rollout, GAE with the
critic, packing and dynamic batch size, validation every round, `trainer.save_freq=5`,
`trainer.max_ckpt_to_keep=1`. Sections of the results JSON:

- `in_process`: `rlhf.train.Run` (what `python -m rlhf.train` runs), `--rounds` rounds;
- `staged`: the stateless functions the one-task-per-stage Flyte workflow calls
  (`rlhf.train.stateless`: rollout_policy, score_rollouts, update_from_checkpoint,
  evaluate_policy), `--staged-rounds` rounds, every function loading what it needs;
- `colocated`: `rlhf.train.segment.run_segment`, the loop of a colocated Flyte segment task
  (see `run_colocated` for the call it gets); otherwise the section says it was skipped.

Per round: wall and its parts (sample, rollout, score, update, evaluate, checkpoint; for
the staged path also verify, trainer build and restore), bytes the process read and wrote
(`/proc/self/io`: rchar/wchar, which count tmpfs too), and checkpoint sizes. The random
model never samples EOS, so every response runs to 256 tokens (the workload's longest).

`gpu_common.synthetic_tokenizer` saved into a Qwen2 directory reloads as a Qwen2
tokenizer that maps every prompt to no tokens, so the benchmark hands its word-level
tokenizer to the drivers in place of `rlhf.models.load.load_tokenizer`.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402

import gpu_common as G  # noqa: E402
from real_scale_workload import N_VAL, TINY, WORKLOAD, config, make_workload, use_word_tokenizer  # noqa: E402


# ---------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------


def io_bytes() -> dict[str, int]:
    """Bytes this process has read and written through system calls (all threads)."""
    try:
        fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
        return {"read": int(fields["rchar"]), "written": int(fields["wchar"])}
    except (OSError, KeyError, ValueError):
        return {"read": 0, "written": 0}


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) if Path(path).exists() else 0


class Rounds:
    """Per-round records of one driver; each record adds wall time and I/O since the last."""

    on_add = None  # called after every record (main: write the results so far)
    last_records: list = []  # the records of the driver running now, kept if it fails

    def __init__(self, device: torch.device):
        self.device, self.records = device, []
        Rounds.last_records = self.records
        self._t, self._io = time.perf_counter(), io_bytes()

    def start(self) -> None:
        G.sync(self.device)
        self._t, self._io = time.perf_counter(), io_bytes()

    def add(self, parts: dict[str, float], **extra) -> dict:
        G.sync(self.device)
        now, io = time.perf_counter(), io_bytes()
        rec = {"round": len(self.records) + 1, "wall_s": now - self._t,
               "parts_s": {k: round(v, 4) for k, v in parts.items()},
               "bytes_read": io["read"] - self._io["read"], "bytes_written": io["written"] - self._io["written"],
               **extra}
        if self.device.type == "cuda":
            rec["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.records.append(rec)
        print(f"  round {rec['round']}: {rec['wall_s']:.2f} s {rec['parts_s']}", flush=True)
        rec["unattributed_s"] = rec["wall_s"] - sum(parts.values())
        self._t, self._io = now, io
        if Rounds.on_add is not None:
            Rounds.on_add(self.records)
        return rec


def summarize(records: list[dict], compute_keys: tuple[str, ...]) -> dict:
    """Mean wall, mean compute (the stages that are the round's work) and their ratio."""
    if not records:
        return {}
    wall = [r["wall_s"] for r in records]
    compute = [sum(r["parts_s"].get(k, 0.0) for k in compute_keys) for r in records]
    return {"rounds": len(records), "wall_mean_s": sum(wall) / len(wall), "compute_mean_s": sum(compute) / len(wall),
            "wall_over_compute": sum(wall) / max(sum(compute), 1e-9), "wall_max_s": max(wall),
            "bytes_written_mean": sum(r["bytes_written"] for r in records) / len(records),
            "bytes_read_mean": sum(r["bytes_read"] for r in records) / len(records)}


def rollout_corr(result) -> dict[str, float]:
    """The round's last step's rollout/trainer mismatch metrics (verl's names); `result` the
    round's update (`rlhf.train.step.StepResult`)."""
    last = result.steps[-1] if result.steps else {}
    return {k: v for k, v in last.items() if k.startswith(("rollout_corr/", "training/rollout_probs"))}


def update_parts(result, cfg) -> dict[str, float]:
    """Tokens (prompt and response) the round's update passes over and the seconds of the
    actor's and the critic's optimisation, from its last step's metrics (one step a round)."""
    m = result.steps[-1] if result.steps else {}
    n = cfg.data.train_batch_size * cfg.rollout.n
    return {"tokens": n * (m.get("prompt_length/mean", 0.0) + m.get("response_length/mean", 0.0)),
            **{f"{r}_s": m[f"timing_s/{r}"] for r in ("update_actor", "update_critic") if f"timing_s/{r}" in m}}


def update_mfu(records: list[dict], cfg, shape: str, lora: bool) -> dict:
    """Model FLOPs utilisation of the actor's and the critic's optimisation passes: per token
    6 N (forward, activation and weight gradients) in full fine-tuning, 4 N with LoRA (the
    frozen weights get no gradient; the adapters' own FLOPs are left out), times ppo_epochs,
    over the step's `timing_s/update_actor` and `timing_s/update_critic`, against one H200's measured
    790 TFLOP/s. N counts every matmul weight of the transformer (not the input embedding);
    the actor adds its LM head."""
    s = G.SHAPES[shape]
    h, f, layers = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    kv = h // s["num_attention_heads"] * s["num_key_value_heads"]
    body = layers * (2 * h * h + 2 * h * kv + 3 * h * f)
    n_actor, n_critic = body + h * s["vocab_size"], body + h
    k = 4 if lora else 6
    out = {"flops_per_token": {"actor": k * n_actor, "critic": k * n_critic}, "peak_flops": G.PEAK_BF16_FLOPS}
    for role, n, epochs in (("actor", n_actor, cfg.actor.ppo_epochs), ("critic", n_critic, cfg.critic.ppo_epochs)):
        rs = [r for r in records if r.get("tokens") and r.get(f"update_{role}_s")]
        if rs:
            flops = sum(k * n * r["tokens"] * epochs for r in rs)
            out[f"mfu_{role}"] = flops / sum(r[f"update_{role}_s"] for r in rs) / G.PEAK_BF16_FLOPS
    return out


def free_device() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# ---------------------------------------------------------------------------------------------
# The drivers
# ---------------------------------------------------------------------------------------------

IN_PROCESS_COMPUTE = ("timing_s/gen", "timing_s/reward", "timing_s/update", "timing_s/testing")


DELETED: list[float] = []  # seconds each save spent deleting the checkpoint before it (--one-checkpoint)


def one_checkpoint_on_disk() -> None:
    """Make every save first delete the checkpoints already there: on a machine whose disk
    (or RAM, for /dev/shm) holds one 1.5B checkpoint and no second, the newest stays only
    until the next one starts. (A run keeps the last one until the new one is sealed, and
    prunes it in the writer's thread.) The time this takes on the training thread is the
    benchmark's, not the driver's: it is recorded per round (`benchmark_delete_s`) and left
    out of the checkpoint stall."""
    from rlhf.checkpoint import rounds as ckpt

    save = ckpt.save

    def save_alone(final, *args, **kwargs):
        t = time.perf_counter()
        writer = kwargs.get("writer")
        if writer is not None:
            writer.wait()
        for old in Path(final).parent.glob("round_*"):
            shutil.rmtree(old, ignore_errors=True)
        DELETED.append(time.perf_counter() - t)
        return save(final, *args, **kwargs)

    ckpt.save = save_alone


def run_in_process(cfg, rounds: int, device: torch.device) -> dict:
    """`rlhf.train.Run`: set-up once, then `rounds` rounds (checkpoint stall: the main
    thread's time in the save plus the time optimizer steps waited for the writer)."""
    from rlhf.train import Run

    t = time.perf_counter()
    run = Run(cfg)
    setup = time.perf_counter() - t
    rec = Rounds(device)
    try:
        for _ in range(rounds):
            rec.start()
            DELETED.clear()
            result, _ = run.round()
            parts = {k: v for k, v in run.timing.items() if k.startswith("timing_s/")}
            deleted = sum(DELETED)
            stall = parts.get("timing_s/save_checkpoint", 0.0) + parts.get("timing_s/checkpoint_wait", 0.0) - deleted
            rec.add(parts, checkpoint_stall_s=stall, benchmark_delete_s=deleted, writer_busy_after_round=run.writer.busy,
                    rollout_corr=rollout_corr(result), **update_parts(result, cfg))
        t = time.perf_counter()
        final_wait = run.flush()
        flushed = time.perf_counter() - t
    finally:
        run.close()
    root = run.out / "checkpoints"
    kept = sorted(p.name for p in root.glob("round_*"))
    del run
    free_device()
    return {"setup_s": setup, "per_round": rec.records, "final_flush_s": flushed, "final_wait_s": final_wait,
            "checkpoints_kept": kept, "checkpoint_bytes": dir_bytes(root / kept[-1]) if kept else 0,
            "summary": {**summarize(rec.records, IN_PROCESS_COMPUTE),
                        "checkpoint_stall_max_s": max((r["checkpoint_stall_s"] for r in rec.records), default=0.0)}}


STAGED_COMPUTE = ("generate", "score", "timing_s/update", "evaluate_generate")


def run_staged(cfg, rounds: int, device: torch.device, outs: list[Path]) -> dict:
    """The stateless functions, one after another as the Flyte tasks call them: each loads
    its model or checkpoint, builds its engine, runs, and writes what the next one reads."""
    from rlhf.train import stateless as P
    from rlhf.round import stages
    from rlhf.round.state import RoundState

    data = P.prepare_dataset(cfg.data)
    base = cfg.model.path
    state, checkpoint = RoundState.initial(cfg), None
    rec = Rounds(device)
    for r in range(rounds):
        rec.start()
        parts: dict[str, float] = {}
        t = time.perf_counter()
        prompts, state = stages.sample_prompts(data.train, state, cfg)
        parts["sample"] = time.perf_counter() - t
        policy = str(Path(checkpoint) / "actor") if checkpoint else base
        t = time.perf_counter()
        rollouts, gen = P.rollout_policy(cfg, policy, prompts, state)
        parts["rollout_total"] = time.perf_counter() - t
        parts["rollout_engine_build"] = gen["timing_s/gen_engine_build"]
        parts["generate"] = gen["timing_s/gen"] - gen["timing_s/gen_engine_build"]
        t = time.perf_counter()
        scored = P.score_rollouts(cfg, rollouts)
        parts["score"] = time.perf_counter() - t
        # Two folders in turn, so the checkpoint read and the one written may sit on two disks.
        res = P.update_from_checkpoint(cfg, base, checkpoint, scored, state, str(outs[r % 2]))
        parts.update(res.timing)
        free_device()
        t = time.perf_counter()
        state, val = P.evaluate_policy(cfg, res.policy, data.val, res.state)
        parts["evaluate_total"] = time.perf_counter() - t
        parts["evaluate_engine_build"] = val["timing_s/testing_engine_build"]
        parts["evaluate_generate"] = val["timing_s/testing"] - val["timing_s/testing_engine_build"]
        rec.add(parts, checkpoint_bytes=dir_bytes(Path(res.checkpoint)))
        if checkpoint:  # the pod's copy of the input goes with the pod; here it is deleted, outside the round
            t = time.perf_counter()
            shutil.rmtree(checkpoint, ignore_errors=True)
            rec.records[-1]["benchmark_delete_s"] = time.perf_counter() - t
        checkpoint = res.checkpoint
        free_device()
    return {"per_round": rec.records, "summary": summarize(rec.records, STAGED_COMPUTE)}


def run_colocated(cfg, rounds: int, device: torch.device) -> dict:
    """`rlhf.train.segment.run_segment`, as the colocated Flyte task calls it: one segment of
    `rounds` rounds from the base policy (tables prepared and fitted first, as the data
    tasks do), its checkpoints every `save_freq` rounds written, sealed and handed to the
    upload callback in the writer's thread, and the segment's closing checkpoint waited for
    (the task returns it). A round's checkpoint stall is, as for the in-process driver, the
    training thread's time in its checkpoint step plus the time its optimizer steps waited
    for the writer's copy."""
    import dataclasses

    from rlhf.round import stages
    from rlhf.models.load import load_tokenizer
    from rlhf.round.policy import prepare_policy
    from rlhf.train.segment import run_segment
    from rlhf.round.state import RoundState

    cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, rounds_per_segment=rounds))
    t = time.perf_counter()
    out = Path(cfg.trainer.output_dir)
    data = stages.prepare_data(cfg)
    base_dir = prepare_policy(cfg, out, data)
    data = stages.fit_data(data, load_tokenizer(base_dir), cfg)
    uploads: list[tuple[str, float]] = []
    rec = Rounds(device)

    def on_round(run, result) -> None:  # after the round's checkpoint step (a save, or host buffers reserved)
        parts = {k: v for k, v in run.timing.items() if k.startswith("timing_s/")}
        deleted = sum(DELETED)
        stall = parts.get("timing_s/save_checkpoint", 0.0) + parts.get("timing_s/checkpoint_wait", 0.0) - deleted
        rec.add(parts, checkpoint_stall_s=stall, benchmark_delete_s=deleted, writer_busy_after_round=run.writer.busy,
                rollout_corr=rollout_corr(result), **update_parts(result, cfg))
        DELETED.clear()
        rec.start()

    prep = time.perf_counter() - t
    from rlhf.train import Run

    build: dict[str, float] = {}
    start = Run.start.__func__

    def timed_start(cls, *args, **kwargs):  # the rounds' clock starts once the segment's engines are built
        t0 = time.perf_counter()
        run = start(cls, *args, **kwargs)
        build["setup_s"] = time.perf_counter() - t0
        rec.start()
        return run

    Run.start = classmethod(timed_start)
    t = time.perf_counter()
    try:
        result = run_segment(cfg, base_dir, data.train, data.val, None, RoundState.initial(cfg), str(out / "segment"),
                             on_checkpoint=lambda path: uploads.append((path.name, time.perf_counter() - t)),
                             on_round=on_round)
    finally:
        Run.start = classmethod(start)
    segment_s = time.perf_counter() - t
    free_device()
    return {"prepare_s": prep, **build, "segment_s": segment_s, "per_round": rec.records, "uploaded": uploads,
            "closing_checkpoint": Path(result.checkpoint).name,
            "summary": {**summarize(rec.records, IN_PROCESS_COMPUTE),
                        "checkpoint_stall_max_s": max((r["checkpoint_stall_s"] for r in rec.records), default=0.0),
                        "closing_checkpoint_wait_s": segment_s - build.get("setup_s", 0.0)
                        - sum(r["wall_s"] for r in rec.records)}}


# ---------------------------------------------------------------------------------------------


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (smoke test)")
    p.add_argument("--rounds", type=int, default=10, help="in-process (and colocated) rounds")
    p.add_argument("--staged-rounds", type=int, default=3)
    p.add_argument("--drivers", default="in_process,staged,colocated")
    p.add_argument("--ckpt-dir", default="", help="where checkpoints go (default: beside --out)")
    p.add_argument("--staged-alt-dir", default="", help="every other staged checkpoint goes here (a second disk: "
                   "one 1.5B checkpoint is 43 GB, and the staged round reads one while it writes the next)")
    p.add_argument("--one-checkpoint", action="store_true", help="delete the checkpoint in place before the "
                   "in-process driver writes the next (a machine with room for one 1.5B checkpoint)")
    p.add_argument("--shape", default="1.5b", choices=["1.5b", "7b"], help="the Qwen2.5 shape of actor and critic "
                   "(ignored with --tiny)")
    p.add_argument("--lora-rank", type=int, default=0, help="> 0: LoRA of this rank on all linear layers of the "
                   "actor and the critic (model.lora_rank, critic.lora_rank), alpha = 2 x rank")
    p.add_argument("--rollout", default="", help="rollout.name (default: the workload's, hf_fast)")
    p.add_argument("--out", default="benchmarks/results/real_scale_h200.json")
    a = p.parse_args(argv)
    if a.one_checkpoint:
        one_checkpoint_on_disk()
    device = G.pick_device(a.tiny)
    torch.set_num_threads(1 if a.tiny else torch.get_num_threads())
    shape, base = ("tiny", TINY) if a.tiny else (a.shape, WORKLOAD)
    if a.lora_rank > 0:
        base = {**base, **{f"{m}.{k}": v for m in ("model", "critic") for k, v in (
            ("lora_rank", a.lora_rank), ("lora_alpha", 2 * a.lora_rank), ("target_modules", ["all-linear"]))}}
    root = Path(a.ckpt_dir or Path(a.out).with_suffix("")) / "work"
    shutil.rmtree(root, ignore_errors=True)
    cfg_base = {**base, "trainer.device": device.type, **({"rollout.name": a.rollout} if a.rollout else {})}
    n_train = base["data.train_batch_size"] * max(a.rounds, a.staged_rounds)
    model_dir, train, val = make_workload(root, shape, device, n_train, N_VAL[shape], base["data.max_prompt_length"])
    use_word_tokenizer(G.SHAPES[shape]["vocab_size"])
    results = {"environment": G.environment(device), "workload": {"shape": shape, **cfg_base},
               "command": " ".join(["python"] + sys.argv)}
    drivers = a.drivers.split(",")
    for name in drivers:
        print(f"{name}:", flush=True)
        out = root / name
        rounds = a.staged_rounds if name == "staged" else a.rounds
        cfg = config(cfg_base, model_dir, train, val, out, rounds)
        Rounds.on_add = lambda records, name=name: G.write_json(a.out, {**results, name: {"partial": records}})
        try:
            if name == "in_process":
                results[name] = run_in_process(cfg, rounds, device)
            elif name == "staged":
                alt = Path(a.staged_alt_dir) / "staged" if a.staged_alt_dir else out
                results[name] = run_staged(cfg, rounds, device, [out / "u0", alt / "u1"])
                shutil.rmtree(alt, ignore_errors=True)
            else:
                results[name] = run_colocated(cfg, rounds, device)
            if name != "staged":
                results[name]["update_mfu"] = update_mfu(results[name]["per_round"], cfg, shape, a.lora_rank > 0)
            if device.type == "cuda":
                results[name]["max_memory_allocated_gb"] = max(
                    (r.get("max_memory_allocated_gb", 0.0) for r in results[name]["per_round"]), default=0.0)
        except Exception as e:  # the other drivers still run and the error is in the results
            import traceback

            results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:],
                             "per_round_before_error": Rounds.last_records}
            print(results[name]["traceback"], flush=True)
        shutil.rmtree(out, ignore_errors=True)
        free_device()
        G.write_json(a.out, results)  # after every driver, so a cut-off call still leaves numbers
    shutil.rmtree(root, ignore_errors=True)
    return results


if __name__ == "__main__":
    main()
