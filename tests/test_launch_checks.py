"""What a launch is checked for before it runs: value ranges, repeated keys, strict JSON, the
position limit, resampling of a small train set, the dry run and its speed, and the tiny
default model warm-started on a user's labeled rows."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf.config import ConfigError, load_config
from rlhf.config.ranges import RANGES, in_range, numeric_keys
from test_trainer import TINY, _clean_env

ROOT = Path(__file__).resolve().parents[1]


# -- ranges -------------------------------------------------------------------------------------


@pytest.mark.parametrize("override,message", [
    ("actor.lr=-1.0", r"'actor.lr' is -1; it must be in \[0, inf\) \(actor learning rate"),
    ("critic.lr=-0.001", r"'critic.lr' is -0.001; it must be in \[0, inf\) \(critic learning rate"),
    ("algorithm.kl_ctrl.kl_coef=.inf", r"'algorithm.kl_ctrl.kl_coef' is infinite; it must be in \[0, inf\)"),
    ("algorithm.kl_ctrl.kl_coef=1e400", r"'algorithm.kl_ctrl.kl_coef' is infinite"),
    ("rollout.top_p=2", r"'rollout.top_p' is 2; it must be in \(0, 1\]"),
    ("rollout.top_k=0", r"'rollout.top_k' is 0; it must be in -1 or \[1, inf\)"),
    ("algorithm.gamma=1.5", r"'algorithm.gamma' is 1.5; it must be in \[0, 1\]"),
    ("model.sft.lr=0", r"'model.sft.lr' is 0; it must be in \(0, inf\)"),
    ("trainer.profile_steps=[3,0]", r"'trainer.profile_steps' is 0"),
    ("trainer.save_freq=0", r"'trainer.save_freq' is 0; it must be in -1 or \[1, inf\)"),
    ("algorithm.rollout_correction.rollout_is_threshold=0",
     r"algorithm.rollout_correction.rollout_is_threshold: rollout_is_threshold '0': bounds must be positive"),
    ("algorithm.rollout_correction.rollout_rs=token_k3",
     r"algorithm.rollout_correction.rollout_rs_threshold: rollout_rs_threshold must be given"),
    ("actor.tis_imp_ratio_cap=0", r"actor.tis_imp_ratio_cap must be > 0, or -1 for off; got 0"),
])
def test_values_no_run_can_use_are_refused_naming_key_and_range(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


@pytest.mark.parametrize("override", ["rollout.top_k=-1", "trainer.save_freq=-1", "early_stop.kl_ceiling=.inf",
                                      "actor.entropy_coeff=-0.01", "actor.lr=0", "model.sft.max_seconds=.inf"])
def test_edge_values_that_runs_use_are_accepted(override):
    load_config(None, [override])


def test_rejection_bounds_that_cross_are_refused_at_launch():
    rs = ["algorithm.rollout_correction.rollout_rs=seq_sum_k1"]
    with pytest.raises(ConfigError, match=r"rollout_rs_threshold '3_2' for seq_sum_k1 needs lower <= upper"):
        load_config(None, rs + ["algorithm.rollout_correction.rollout_rs_threshold='3_2'"])
    with pytest.raises(ConfigError, match=r"'0.5' for seq_sum_k1 needs lower <= upper"):  # lower defaults to 1 / upper
        load_config(None, rs + ["algorithm.rollout_correction.rollout_rs_threshold=0.5"])
    load_config(None, rs + ["algorithm.rollout_correction.rollout_rs_threshold='0.9_1.5'"])
    load_config(None, ["algorithm.rollout_correction.preset=decoupled_geo_rs"])


def test_every_numeric_key_has_a_range_and_the_defaults_lie_in_it():
    from rlhf.config import PPOConfig, flatten

    assert sorted(numeric_keys()) == sorted(RANGES), "give each new numeric config key a range in RANGES"
    flat = flatten(PPOConfig())
    for key, spec in RANGES.items():
        values = flat[key] if isinstance(flat[key], list) else [flat[key]]
        assert all(in_range(float(v), spec) for v in values if v is not None), (key, flat[key], spec)
    assert not in_range(math.nan, "(-inf, inf)")


def test_a_key_given_twice_on_the_command_line_is_warned_about():
    with pytest.warns(UserWarning, match=r"'actor.lr' is given 2 times on the command line \(1e-3, 5e-4\); the "
                                         r"last one \(5e-4\) is used"):
        cfg = load_config(None, ["actor.lr=1e-3", "critic.lr=1e-3", "actor.lr=5e-4"])
    assert cfg.actor.lr == 5e-4


# -- strict JSON --------------------------------------------------------------------------------


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_summary_json_holds_null_for_non_finite_numbers_and_says_so(tmp_path):
    from rlhf.tracking.results import write_summary

    summary = {"val_score_end": math.inf, "kl_coef": math.nan, "rounds": 2,
               "val_history": [{"step": 0.0, "score": -math.inf}, {"step": 1.0, "score": 0.5}]}
    path = write_summary(tmp_path / "summary.json", summary)
    data = _strict(path.read_text())
    assert data["val_score_end"] is None and data["kl_coef"] is None and data["val_history"][0]["score"] is None
    assert data["val_history"][1]["score"] == 0.5 and data["rounds"] == 2
    assert data["nonfinite_keys"] == ["val_score_end", "kl_coef", "val_history[0].score"]
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"], "a temporary file was left behind"


# -- position limit and resampling ----------------------------------------------------------------


def test_a_gguf_model_file_passes_the_launch_check_and_a_stray_file_does_not(tmp_path):
    """model.path may name a GGUF file (converted once when the run starts); any other file is
    refused with the fix."""
    from rlhf.train.check import CheckFailed, preflight

    (tmp_path / "policy.gguf").write_bytes(b"GGUF")
    plan = preflight(load_config(None, [f"model.path={tmp_path / 'policy.gguf'}"]))
    assert any("policy.gguf (GGUF" in line for line in plan.lines)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(CheckFailed, match="is a file; pass the save_pretrained directory"):
        preflight(load_config(None, [f"model.path={tmp_path / 'weights.bin'}"]))


def test_sequences_longer_than_the_tiny_models_position_limit_are_refused():
    from rlhf.train.check import preflight

    cfg = load_config(None, ["data.max_prompt_length=196", "data.max_response_length=16"])
    with pytest.raises(ConfigError, match=r"196 \+ 16 = 212 tokens, more than the policy's position limit of 128 "
                                          r"\(model.tiny.max_position_embeddings\); lower data.max_prompt_length"):
        preflight(cfg)


def test_sequences_longer_than_a_model_dirs_position_limit_are_refused(tmp_path):
    from rlhf.data.checks import check_position_limit

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 128}))
    cfg = load_config(None, [f"model.path={tmp_path}", "data.max_prompt_length=200", "data.max_response_length=12"])
    with pytest.raises(ConfigError, match=r"= 212 tokens, more than the policy's position limit of 128 "
                                          r"\(max_position_embeddings in .*config.json\)"):
        check_position_limit(cfg)
    check_position_limit(load_config(None, [f"model.path={tmp_path}", "data.max_prompt_length=100"]))


def _user_data(tmp_path: Path, n_train: int = 10, labeled: bool = True) -> list[str]:
    from rlhf.data.arithmetic import make_arithmetic

    train = make_arithmetic(n_train, seed=1)
    if not labeled:
        train = train.assign(reward_style="model", ground_truth=None)
    train.assign(data_source="openai/gsm8k").to_parquet(tmp_path / "train.parquet")
    make_arithmetic(8, seed=2).assign(data_source="openai/gsm8k").to_parquet(tmp_path / "val.parquet")
    return [f"data.train_files={tmp_path}/train.parquet", f"data.val_files={tmp_path}/val.parquet"]


def test_a_small_train_set_resampled_many_times_a_round_is_warned_about(tmp_path, caplog):
    from rlhf.train.check import preflight
    from rlhf.data.checks import warn_resampling

    cfg = load_config(None, _user_data(tmp_path, 10) + ["data.train_batch_size=64"])
    (warning,) = preflight(cfg).warnings
    assert "the train set has 10 prompts but a round draws 64" in warning and "about 6.4 times a round" in warning
    assert "lower data.train_batch_size to at most 10" in warning
    with caplog.at_level(logging.WARNING, logger="rlhf.data.checks"):
        warn_resampling(10, cfg)
    assert "about 6.4 times" in caplog.text
    assert warn_resampling(64, cfg) == "" and not preflight(load_config(None, [])).warnings


# -- the tiny model on user data ------------------------------------------------------------------


def test_the_tiny_model_warm_starts_on_labeled_user_rows(tmp_path, one_thread):
    from rlhf.train import stateless as P
    from rlhf.round import stages
    from rlhf.round.policy import prepare_policy

    cfg = load_config(None, TINY + _user_data(tmp_path, 40))
    data = stages.prepare_data(cfg)
    assert data.sft is None
    policy = Path(prepare_policy(cfg, tmp_path / "out", data))
    assert (policy / "config.json").is_file()
    sft = json.loads((policy / "sft_metrics.json").read_text())
    assert sft, "the warm-start did not run"
    # The Flyte path hands the same labeled rows to prepare_policy.
    flyte_sft = P.prepare_dataset(cfg.data).sft
    assert len(flyte_sft) == 40 and flyte_sft["ground_truth"].notna().all()


def test_user_data_without_labels_says_how_to_warm_start(tmp_path):
    from rlhf.round import stages
    from rlhf.round.policy import prepare_policy

    cfg = load_config(None, TINY + _user_data(tmp_path, 8, labeled=False))
    with pytest.raises(ValueError, match="the train set has none .* add ground truths to data.train_files, or set "
                                         "model.path"):
        prepare_policy(cfg, tmp_path / "out", stages.prepare_data(cfg))


# -- the dry run -----------------------------------------------------------------------------------


def _cli(*args: str, cwd: Path, module: str = "rlhf.train") -> tuple[subprocess.CompletedProcess, float]:
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", module, *args], env=_clean_env(), capture_output=True, text=True,
                          timeout=300, cwd=cwd)
    return proc, time.perf_counter() - t


@pytest.mark.parametrize("module", ["rlhf.train", "rlhf.train.check"])
def test_mistakes_are_reported_with_the_message_alone_before_heavy_imports(tmp_path, module):
    extra = ["--dry-run"] if module == "rlhf.train" else []
    for args, message in ((["critic.lr=-1"], "error: config key 'critic.lr' is -1"),
                          (["data.train_files=missing.parquet", "data.val_files=v.parquet"],
                           "error: missing.parquet: no such file"),
                          ([f"model.path={tmp_path}/nope"], f"model path '{tmp_path}/nope' is not a local directory")):
        proc, _ = _cli(*extra, *args, cwd=tmp_path, module=module)
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "deepspeed" not in proc.stderr.lower()


def test_dry_run_checks_a_launch_without_running_it(tmp_path):
    out = tmp_path / "out"
    proc, seconds = _cli("--dry-run", *_user_data(tmp_path, 10), "data.train_batch_size=16",
                         f"trainer.output_dir={out}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "launch checked: nothing was run" in proc.stdout
    assert "data: 10 train rows" in proc.stdout and "warm-start: the tiny model on 10 labeled train rows" in proc.stdout
    assert "warning: the train set has 10 prompts but a round draws 16" in proc.stdout
    assert not out.exists(), "the dry run wrote outputs"
    assert "Setting accelerator" not in proc.stderr, "the dry run imported DeepSpeed"


# -- the check tells what the run does, every mistake at once -----------------------------------------


def _plan_rounds(stdout: str) -> int:
    line = next(line for line in stdout.splitlines() if line.strip().startswith("rounds: "))
    return int(line.split()[1])


def test_the_dry_run_counts_the_rounds_of_trainer_total_epochs_as_the_run_does(tmp_path, two_rounds, capsys):
    """`trainer.total_epochs=2` over 10 user prompts of which 3 are too long for
    data.max_prompt_length: the run counts the rounds of 2 epochs of the 7 it keeps, and the
    dry run says the same number (before: trainer.total_rounds, 100)."""
    from rlhf.config.sizes import rounds_for_epochs
    from rlhf.data.arithmetic import make_arithmetic
    from rlhf.train import Run
    from rlhf.train.cli import main

    train = make_arithmetic(10, seed=1).assign(data_source="openai/gsm8k")
    train.loc[:2, "prompt"] = "1+" * 30 + "1="
    train.to_parquet(tmp_path / "train.parquet")
    make_arithmetic(8, seed=2).assign(data_source="openai/gsm8k").to_parquet(tmp_path / "val.parquet")
    args = [*TINY, f"data.train_files={tmp_path}/train.parquet", f"data.val_files={tmp_path}/val.parquet",
            f"model.path={two_rounds / 'base_model'}", "data.max_prompt_length=32", "trainer.total_epochs=2",
            "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", f"trainer.output_dir={tmp_path / 'out'}"]
    assert main(["--dry-run", *args]) == 0
    planned = _plan_rounds(capsys.readouterr().out)
    cfg = load_config(None, args)
    run = Run(cfg)
    try:
        assert planned == run.cfg.trainer.total_rounds == rounds_for_epochs(cfg, 7) != rounds_for_epochs(cfg, 10)
    finally:
        run.close()


@pytest.mark.parametrize("module", ["rlhf.train", "rlhf.train.check"])
def test_every_mistake_of_a_launch_is_reported_in_one_pass_with_true_hints(tmp_path, capsys, module):
    """Two wrong values in the config file, one wrong override, batch sizes that do not divide and
    a model directory that is not there: one run of the check names all five; the hint for a
    local path says to check it (before: one mistake per run, and `hf download /...`)."""
    import importlib

    main = importlib.import_module("rlhf.train.cli" if module == "rlhf.train" else module).main
    cfg_file = tmp_path / "my.yaml"
    cfg_file.write_text("actor:\n  clip_ratio: 2\ntrainer:\n  save_freq: 0\n  total_rounds: 3\n")
    extra = ["--dry-run"] if module == "rlhf.train" else []
    with pytest.raises(SystemExit) as stop:
        main([*extra, "critic.lr=-1", "--cfg", str(cfg_file), "data.train_batch_size=7",
              f"model.path={tmp_path}/no/such/model"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("error: 5 mistakes in this launch:"), err
    for part in (f"{cfg_file}: actor.clip_ratio must be in (0, 1)", f"{cfg_file}: config key 'trainer.save_freq' is 0",
                 "config key 'critic.lr' is -1", "must divide data.train_batch_size (7)",
                 f"model path '{tmp_path}/no/such/model' is not a local directory: nothing is there; check the path"):
        assert part in err, (part, err)
    assert "hf download" not in err


@pytest.mark.parametrize("module", ["rlhf.train", "rlhf.train.check"])
def test_overrides_may_stand_before_and_after_cfg(tmp_path, capsys, module):
    import importlib

    main = importlib.import_module("rlhf.train.cli" if module == "rlhf.train" else module).main
    cfg_file = tmp_path / "my.yaml"
    cfg_file.write_text("trainer:\n  test_freq: 2\n")
    extra = ["--dry-run"] if module == "rlhf.train" else []
    assert main([*extra, "trainer.total_rounds=2", "--cfg", str(cfg_file), "trainer.steps_per_round=3"]) == 0
    out = capsys.readouterr().out
    assert "rounds: 2 x 3 steps" in out and "validation every 2 round(s)" in out, out
