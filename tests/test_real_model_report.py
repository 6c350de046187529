"""benchmarks/real_model*: the TRL lanes' schedule against the PPO lane's, and the report
across seeds (mean, standard error, fixed times, PPO's lead paired by seed)."""

import json
import math

import pytest

from benchmarks.real_model_common import EXAMPLE_CFG, ppo_schedule
from benchmarks.real_model_report import aggregate, first_at_or_after, mean_se, write_summary
from benchmarks.real_model_trl import SCHEDULE_SETTINGS, SETTINGS, settings
from rlhf.config import load_config


def test_the_second_trl_lane_has_the_ppo_lanes_samples_and_updates_per_generation():
    sched = ppo_schedule(load_config(str(EXAMPLE_CFG)))
    assert (sched["samples"], sched["updates"], sched["update_samples"]) == (256, 8, 64)
    same = settings("trl_ppo_schedule", sched, 1e-5, 128, 0, on_cpu=False, smoke=False)
    assert same["per_device_train_batch_size"] * same["steps_per_generation"] == 256
    assert same["steps_per_generation"] * same["num_iterations"] == 8 and same["num_generations"] == 4
    users = settings("trl", sched, 1e-5, 128, 0, on_cpu=False, smoke=False)
    assert (users["num_generations"], users["per_device_train_batch_size"]) == (8, 64)
    assert "steps_per_generation" not in users and "num_iterations" not in users  # TRL's defaults
    assert users["bf16"] and "model_init_kwargs" not in users  # float32 weights under bf16 autocast
    assert set(users) | set(same) <= set(SETTINGS) | set(SCHEDULE_SETTINGS), "every setting has its reason"


def _run(seed: int, ppo: list[float], trl: list[float], heldout: dict[str, float]) -> dict:
    times = [0.0, 49.0, 92.0]
    curve = lambda xs: [{"train_s": t, "strict": x, "round": i * 4} for i, (t, x) in enumerate(zip(times, xs))]
    return {"seed": seed, "task": "word_problems", "command": f"seed {seed}",
            "sizes": {"budget": 90, "eval_every": 45, "n_val": 200},
            "lanes": {"ppo": {"curve": curve(ppo)}, "trl": {"curve": curve(trl)}},
            "heldout": {"policies": {k: {"own": {"strict": v}, "other": {"strict": v / 2}}
                                     for k, v in heldout.items()}}}


RUNS = [_run(0, [0.2, 0.4, 0.5], [0.2, 0.3, 0.4], {"ppo": 0.5, "trl": 0.4}),
        _run(1, [0.2, 0.5, 0.6], [0.2, 0.3, 0.4], {"ppo": 0.6, "trl": 0.4}),
        _run(2, [0.2, 0.5, 0.7], [0.2, 0.4, 0.5], {"ppo": 0.7, "trl": 0.5})]


def test_mean_and_standard_error_across_seeds_at_fixed_times_and_the_paired_lead():
    assert mean_se([]) == {"mean": None, "se": None, "n": 0} and mean_se([0.3])["se"] is None
    assert first_at_or_after(RUNS[0]["lanes"]["ppo"]["curve"], 45)["train_s"] == 49.0
    agg = aggregate(RUNS)
    ppo = agg["lanes"]["ppo"]
    assert agg["times"] == [0, 45, 90]
    assert ppo["end"]["mean"] == pytest.approx(0.6) and ppo["end"]["se"] == pytest.approx(0.1 / math.sqrt(3))
    assert ppo["at_train_s"]["45"]["mean"] == pytest.approx(1.4 / 3) and ppo["at_train_s"]["45"]["train_s"] == 49
    assert ppo["end_rounds"]["mean"] == 8 and ppo["complete"] == [0, 1, 2]
    lead = agg["ppo_lead"]["trl"]["end"]  # per seed 0.1, 0.2, 0.2
    assert lead["mean"] == pytest.approx(0.5 / 3) and lead["se"] == pytest.approx(math.sqrt(1 / 300) / math.sqrt(3))
    assert lead["in_se"] == pytest.approx(lead["mean"] / lead["se"])
    assert agg["ppo_lead"]["trl"]["heldout_other"]["mean"] == pytest.approx(0.5 / 6)


def test_each_lanes_gain_over_its_start_paired_by_seed():
    runs = [_run(s, ppo, trl, {"start": st, "ppo": p, "trl": t})
            for s, ppo, trl, st, p, t in [(0, [0.2, 0.4, 0.1], [0.3, 0.3, 0.4], 0.2, 0.1, 0.3),
                                          (1, [0.2, 0.5, 0.1], [0.2, 0.3, 0.4], 0.3, 0.1, 0.3),
                                          (2, [0.3, 0.5, 0.1], [0.2, 0.4, 0.5], 0.2, 0.0, 0.4)]]
    gain = aggregate(runs)["gain"]
    # a lane that falls below its start: last in-run evaluation minus its first, per seed -0.1, -0.1, -0.2
    assert gain["ppo"]["end"]["mean"] == pytest.approx(-0.4 / 3) and gain["ppo"]["end"]["in_se"] < 0
    assert gain["trl"]["end"]["mean"] == pytest.approx(0.2)
    # the common evaluator: the final policy minus the start on each test set, per seed
    assert gain["ppo"]["heldout_own"]["mean"] == pytest.approx(-0.5 / 3)
    assert gain["trl"]["heldout_other"]["mean"] == pytest.approx(0.05) and gain["trl"]["heldout_own"]["n"] == 3
    # a seed without the start's held-out score counts only in the in-run gain
    del runs[2]["heldout"]["policies"]["start"]
    gain = aggregate(runs)["gain"]
    assert gain["ppo"]["heldout_own"]["n"] == 2 and gain["ppo"]["end"]["n"] == 3


def test_the_summary_files(tmp_path):
    dirs = []
    for r in RUNS:
        d = tmp_path / f"seed{r['seed']}"
        d.mkdir()
        (d / "results.json").write_text(json.dumps(r))
        dirs.append(str(d))
    write_summary(dirs, tmp_path / "summary")
    saved = json.loads((tmp_path / "summary" / "summary.json").read_text())
    assert saved["seeds"] == [0, 1, 2] and saved["runs"] == dirs
    table = (tmp_path / "summary" / "summary.md").read_text()
    assert "| ppo | 0.467 +- 0.033 | 0.600 +- 0.058 |" in table
    # PPO's lead over trl at the end, on its own test split and on the other generator, each in SEs
    assert "| trl | 0.167 +- 0.033 | 5.0 | 0.167 +- 0.033 | 5.0 | 0.083 +- 0.017 | 5.0 |" in table
    assert (tmp_path / "summary" / "summary.png").stat().st_size > 10_000


@pytest.mark.parametrize("field, other", [("machine", {"gpu": "NVIDIA H200"}), ("sizes", {"budget": 180})])
def test_seeds_from_another_gpu_or_other_settings_are_not_averaged_together(tmp_path, field, other):
    dirs = []
    for r in RUNS:
        r = json.loads(json.dumps(r)) | {"machine": {"gpu": "NVIDIA H100 80GB HBM3"}}
        if r["seed"] == 2:
            r[field] = r.get(field, {}) | other
        d = tmp_path / f"seed{r['seed']}"
        d.mkdir()
        (d / "results.json").write_text(json.dumps(r))
        dirs.append(str(d))
    with pytest.raises(SystemExit, match=f"differ in their .*{tmp_path / 'seed2'}"):
        write_summary(dirs, tmp_path / "summary")
    assert not (tmp_path / "summary").exists()
    write_summary(dirs[:2], tmp_path / "summary")  # the two that agree
    assert json.loads((tmp_path / "summary" / "summary.json").read_text())["seeds"] == [0, 1]


def test_the_lora_lane_is_the_ppo_lane_with_adapters_and_ten_times_the_learning_rates(tmp_path):
    from benchmarks.real_model import lane_command, parse_args
    from benchmarks.real_model_common import LORA_LR_FACTOR, lane_parser, ppo_config

    common = ["--start", "s", "--data-dir", str(tmp_path), "--policy-out", "p", "--budget", "1", "--eval-every",
              "1", "--max-response", "8", "--max-prompt", "8", "--lane-out", str(tmp_path / "lane.json")]
    full = ppo_config(lane_parser("x").parse_args(["--lane", "ppo", *common]))
    lora = ppo_config(lane_parser("x").parse_args(["--lane", "ppo_lora", "--lora-rank", "16", *common]))
    assert full.model.lora_rank == full.critic.lora_rank == 0
    assert (lora.model.lora_rank, lora.model.lora_alpha, lora.critic.lora_rank) == (16, 16, 16)
    assert lora.model.target_modules == ["all-linear"] == lora.critic.target_modules
    assert lora.actor.lr == pytest.approx(full.actor.lr * LORA_LR_FACTOR)
    assert lora.critic.lr == pytest.approx(full.critic.lr * LORA_LR_FACTOR)
    assert lora.data.train_batch_size == full.data.train_batch_size and lora.rollout.n == full.rollout.n
    # the orchestrator starts the lane with this project's PPO script, its rank passed on
    a = parse_args(["--out", str(tmp_path), "--lanes", "ppo,ppo_lora", "--lora-rank", "16"])
    cmd = lane_command(a, "ppo_lora", {"budget": 1, "eval_every": 1, "max_response": 8, "max_prompt": 8},
                       tmp_path, str(tmp_path))
    assert cmd[1] == "benchmarks/real_model_ppo.py" and cmd[cmd.index("--lora-rank") + 1] == "16"


def test_a_failed_lane_is_named_and_left_out_of_the_means_and_the_paired_lead(tmp_path):
    runs = json.loads(json.dumps(RUNS))
    # seed 1's trl lane ran out of GPU memory after its first evaluation: its short curve is on disk
    runs[1]["lanes"]["trl"] = {"curve": [{"train_s": 0.0, "strict": 0.2, "round": 0}], "rc": 1,
                               "failure": "torch.OutOfMemoryError: CUDA out of memory."}
    runs[1]["heldout"]["policies"].pop("trl")
    agg = aggregate(runs)
    trl = agg["lanes"]["trl"]
    assert trl["seeds"] == [0, 2] and trl["failed"] == {1: "torch.OutOfMemoryError: CUDA out of memory."}
    assert trl["end"]["mean"] == pytest.approx(0.45) and trl["end"]["n"] == 2  # not (0.4 + 0.2 + 0.5) / 3
    assert agg["ppo_lead"]["trl"]["end"]["n"] == 2 and agg["lanes"]["ppo"]["end"]["n"] == 3
    dirs = []
    for r in runs:
        (tmp_path / f"s{r['seed']}").mkdir()
        (tmp_path / f"s{r['seed']}" / "results.json").write_text(json.dumps(r))
        dirs.append(str(tmp_path / f"s{r['seed']}"))
    table = (write_summary(dirs, tmp_path / "out"), (tmp_path / "out" / "summary.md").read_text())[1]
    assert "| trl (2 of 3 seeds) |" in table and "- trl, seed 1: torch.OutOfMemoryError" in table


def test_a_lane_failure_is_read_from_its_log(tmp_path):
    from benchmarks.real_model import lane_failure

    log = tmp_path / "ppo.log"
    log.write_text("round 1\n[rank0]: Traceback (most recent call last):\n"
                   "[rank0]: rlhf.trainer.faults.RecoverableOOMError: out of device memory in the PPO update "
                   "(CUDA out of memory. Tried to allocate 28.00 MiB.)\nValueError: later\n")
    assert lane_failure(log).startswith("[rank0]: rlhf.trainer.faults.RecoverableOOMError: out of device memory")
    log.write_text("Traceback (most recent call last):\n  File \"x.py\", line 1\nKeyError: 'prompt'\n")
    assert lane_failure(log) == "KeyError: 'prompt'"
    log.write_text("killed\n")
    assert lane_failure(log) == "" and lane_failure(tmp_path / "missing.log") == ""


def test_gsm_symbolic_warm_starts_longer_than_word_problems_unless_told(tmp_path):
    from benchmarks.real_model import parse_args, sizes

    assert sizes(parse_args(["--out", str(tmp_path)]))["sft_steps"] == 10
    assert sizes(parse_args(["--out", str(tmp_path), "--task", "gsm_symbolic"]))["sft_steps"] == 96
    assert sizes(parse_args(["--out", str(tmp_path), "--task", "gsm_symbolic", "--sft-steps", "20"]))["sft_steps"] == 20


def test_gsm_symbolic_accumulates_the_same_ppo_update_in_smaller_micro_batches(tmp_path):
    from benchmarks.real_model import lane_command, parse_args
    from benchmarks.real_model_common import lane_parser, ppo_config

    s = {"budget": 1, "eval_every": 1, "max_response": 8, "max_prompt": 8}

    def lane_cfg(*argv):
        cmd = lane_command(parse_args(["--out", str(tmp_path), *argv]), "ppo", s, tmp_path, str(tmp_path))
        return ppo_config(lane_parser("x").parse_args(cmd[2:]))

    words, gsm = lane_cfg(), lane_cfg("--task", "gsm_symbolic")
    assert words.actor.ppo_micro_batch_size_per_gpu == words.critic.ppo_micro_batch_size_per_gpu == 64
    assert gsm.actor.ppo_micro_batch_size_per_gpu == gsm.critic.ppo_micro_batch_size_per_gpu == 16
    assert ppo_schedule(gsm) == ppo_schedule(words)  # the same samples and updates per generation
    told = lane_cfg("--task", "gsm_symbolic", "--ppo-override", "actor.ppo_micro_batch_size_per_gpu=32")
    assert told.actor.ppo_micro_batch_size_per_gpu == 32  # the caller's override comes last
