"""The hyperparameter sweep: Optuna over PPO's `kl_coef`, `clip_ratio` and `entropy_coeff`
(or any config keys), as a Flyte workflow.

    pyflyte run sweeps/sweep.py ppo_sweep                         # embedded default, CPU
    pyflyte run sweeps/sweep.py ppo_sweep --cfg my.yaml --sweep sweep.yaml

The dataset and the starting policy are prepared once; then `sweep_batches` (a `@dynamic`)
asks `batch_size` trials from the study, runs them as parallel `ppo_trial` sub-workflows
(the PPO rounds on each trial's config, its `decide` step reporting to the study's pruner),
tells their results back, and recurses, so the sampler always sees finished trials. A
trial that raises comes back empty from the failure-tolerant array node and is told FAIL.
The study lives in an RDB storage (SQLite under `trainer.output_dir` by default; a
PostgreSQL URL in `sweep.study.storage` when trials run in other pods), so relaunching
with the same study name continues it. With mlflow in `trainer.logger` every launch has
one parent run and a nested run per trial. `finish_sweep` writes the summary and the best
trial's config (`--cfg` for `workflows/ppo.py ppo_pipeline`) and shows the Optuna plots.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Optional

from flytekit import Deck, LaunchPlan, dynamic, map_task, task, workflow
from flytekit.types.directory import FlyteDirectory
from flytekit.types.file import FlyteFile

from containers.images import CPU_IMAGE
from rlhf.config import PPOConfig, load_config
from rlhf.state import RoundState
from sweeps import report as R
from sweeps.steps import (SweepConfig, check_sweep, close_trial_run, enqueue_default, mlflow_sink, open_parent_run,
                          open_trial_run, plan_batch, tell)
from sweeps.study import StudySpec, open_study, storage_url
from sweeps.trial import TrialContext
from tasks.base import CPU_SMALL, DECK_FIELDS, TRACKING_SECRETS, Prompts
from tasks.data import fit_prompts, prepare_policy
from tasks.run import check_config, report
from workflows.ppo import prepare_data, ppo_round

# The embedded default: the tiny arithmetic task on a short schedule. Everything the sweep's
# wall time depends on is set here rather than taken from the library defaults. The SFT
# warm-start is the library default's (its step cap sits well past the phase change on every
# seed and numeric variant measured, benchmarks/results/sft_reliability_*.json): a shorter cap
# here once ended the warm-start before the phase change on another machine.
SHORT_SCHEDULE = [
    "trainer.total_rounds=4", "trainer.test_freq=1", "trainer.val_before_train=false",
    "trainer.logger=[mlflow]", "trainer.seed=0",
    "data.synthetic.n_train=4000", "data.synthetic.n_val=200",
    "data.train_batch_size=64", "rollout.n=4", "actor.ppo_mini_batch_size=16",
    "rollout.temperature=1.0", "algorithm.kl_ctrl.target_kl=0.1", "early_stop.kl_ceiling=0.2",
]
SWEEP_CFG = load_config(None, SHORT_SCHEDULE)
# Pruning starts once two batches completed, from round 2: val scores after one round differ
# by less than the val set's noise.
DEFAULT_SWEEP = SweepConfig(study=StudySpec(name="ppo-sweep-tiny", n_startup_trials=4, n_warmup_steps=2), n_trials=8,
                            batch_size=2)
# A trial that raises fails its array-node slot only; the node (and the sweep) fails when
# no trial of a batch succeeds (Flyte needs at least one).
MIN_SUCCESS_RATIO = 1e-6


@dataclass
class SweepRun:
    """What every step of one launch shares: the resolved storage, the MLflow parent run."""

    storage: str = ""
    parent_run_id: str = ""  # "" => no MLflow
    first_number: int = 0  # the first trial number this launch can ask
    started_at: float = 0.0  # time.time() at the start


@dataclass
class SweepSummary:
    study: str = ""
    n_trials: int = 0  # trials in the study (all launches)
    launched: int = 0  # trials this launch added
    states: dict[str, int] = field(default_factory=dict)
    best_trial: int = -1
    best_params: dict[str, str] = field(default_factory=dict)
    best_values: list[float] = field(default_factory=list)
    best_val_score: float = -1.0
    default_trial: int = -1
    default_val_score: float = -1.0
    best_config: str = ""  # path of the best trial's config YAML
    wall_s: float = 0.0


Swept = NamedTuple("Swept", [("summary", SweepSummary), ("best_config", Optional[FlyteFile])])


@task(requests=CPU_SMALL, container_image=CPU_IMAGE, retries=2, secret_requests=TRACKING_SECRETS)
def start_sweep(cfg: PPOConfig, sweep: SweepConfig) -> SweepRun:
    """Check the sweep, open (or continue) its study, queue the default config's own trial
    once per study, and open the launch's MLflow parent run."""
    check_sweep(sweep)
    storage = storage_url(sweep.study, cfg.trainer.output_dir)
    study = open_study(sweep.study, storage)
    first = len(study.get_trials(deepcopy=False))
    if sweep.run_default:
        enqueue_default(study, cfg, sweep.space)
    return SweepRun(storage=storage, parent_run_id=open_parent_run(cfg, sweep, storage), first_number=first,
                    started_at=time.time())


@workflow
def ppo_trial(trial: TrialContext, cfg: PPOConfig, run_id: str, train: Prompts, val: Prompts,
              base_model: FlyteDirectory) -> RoundState:
    """One trial: the PPO rounds from `base_model` on the trial's config, reporting each
    round's val score to the study (pruned trials stop early); returns the final state."""
    checked = check_config(cfg=cfg)
    rounds = ppo_round(cfg=checked, train=train, val=val, base_model=base_model, policy=base_model,
                       checkpoint=None, state=None, run_id=run_id, trial=trial)
    report(cfg=checked, state=rounds.state, run_id=run_id)
    return rounds.state


ppo_trial_lp = LaunchPlan.get_or_create(ppo_trial)  # the default launch plan: what the array node maps over


@task(requests=CPU_SMALL, container_image=CPU_IMAGE, secret_requests=TRACKING_SECRETS)
def tell_trials(sweep: SweepConfig, run: SweepRun, trials: list[TrialContext], cfgs: list[PPOConfig],
                run_ids: list[str], states: list[Optional[RoundState]], told: int) -> int:
    """Tell the batch's results (None: the trial raised => FAIL) to the study and to each
    trial's MLflow run; returns the number of trials this launch has told."""
    study = open_study(sweep.study, run.storage)
    results = tell(study, [t.number for t in trials], cfgs, states, sweep)
    for (_, status, values, metrics), cfg, run_id in zip(results, cfgs, run_ids, strict=True):
        close_trial_run(cfg, run_id, status, values, metrics)
    return told


@dynamic(requests=CPU_SMALL, container_image=CPU_IMAGE, secret_requests=TRACKING_SECRETS)
def sweep_batches(cfg: PPOConfig, sweep: SweepConfig, run: SweepRun, train: Prompts, val: Prompts,
                  base_model: FlyteDirectory, told: int) -> int:
    """Ask the next batch, run its trials in parallel, tell them, then the next batch: the
    recursion waits for `tell_trials`, so every ask sees all earlier trials finished."""
    if told >= sweep.n_trials:
        return told
    k = min(sweep.batch_size, sweep.n_trials - told)
    planned = [p for p in plan_batch(open_study(sweep.study, run.storage), sweep.space, cfg, k) if p.cfg]
    trials = [TrialContext(study=sweep.study, storage=run.storage, number=p.number) for p in planned]
    cfgs = [p.cfg for p in planned]
    run_ids = [open_trial_run(p, run.parent_run_id, sweep.study.name) for p in planned]
    states = []
    if planned:
        n = len(planned)
        states = map_task(ppo_trial_lp, concurrency=n, min_success_ratio=MIN_SUCCESS_RATIO)(
            trial=trials, cfg=cfgs, run_id=run_ids, train=[train] * n, val=[val] * n, base_model=[base_model] * n)
    done = tell_trials(sweep=sweep, run=run, trials=trials, cfgs=cfgs, run_ids=run_ids, states=states,
                       told=told + k)
    return sweep_batches(cfg=cfg, sweep=sweep, run=run, train=train, val=val, base_model=base_model, told=done)


@task(requests=CPU_SMALL, container_image=CPU_IMAGE, enable_deck=True, deck_fields=DECK_FIELDS,
      secret_requests=TRACKING_SECRETS)
def finish_sweep(cfg: PPOConfig, sweep: SweepConfig, run: SweepRun, told: int) -> Swept:
    """The summary (best trial against the default config's trial), the best trial's config
    as YAML, the Optuna plots as decks, and the parent MLflow run closed with both."""
    study = open_study(sweep.study, run.storage)
    data = R.summary(study, run.first_number)
    data["wall_s"] = time.time() - run.started_at
    out_dir = Path(cfg.trainer.output_dir).resolve() / "sweeps" / sweep.study.name
    best_cfg = R.best_config(study, cfg)
    best_path = out_dir / "best_config.yaml"
    if best_cfg is not None:
        R.write_config_yaml(best_cfg, best_path, f"best trial {data['best']['number']} of sweep "
                                                 f"'{sweep.study.name}' (objective {data['best']['values']})")
        data["best_config"] = str(best_path)
    R.write_summary_json(data, out_dir / "summary.json")
    for i, (title, fig) in enumerate(R.figures(study).items()):
        Deck(title, R.figure_html(fig, with_plotly_js=i == 0))
    _close_parent(cfg, run, data, out_dir)
    return Swept(summary=_summary(data, told), best_config=FlyteFile(str(best_path)) if best_cfg else None)


def _summary(data: dict, told: int) -> SweepSummary:
    best, default = data["best"], data["default"]
    return SweepSummary(
        study=data["study"], n_trials=data["n_trials"], launched=told, states=data["states"],
        best_trial=best.get("number", -1), best_params={k: repr(v) for k, v in best.get("params", {}).items()},
        best_values=best.get("values", []), best_val_score=_or(best.get("final_val"), -1.0),
        default_trial=default.get("number", -1), default_val_score=_or(default.get("final_val"), -1.0),
        best_config=data.get("best_config", ""), wall_s=data["wall_s"])


def _or(value, fallback: float) -> float:
    return fallback if value is None else float(value)


def _close_parent(cfg: PPOConfig, run: SweepRun, data: dict, out_dir: Path) -> None:
    if not run.parent_run_id:
        return
    sink = mlflow_sink(cfg, run_id=run.parent_run_id)
    numbers = {"sweep/n_trials": data["n_trials"], "sweep/wall_s": data["wall_s"]}
    for key in ("best_val_score", "default_val_score"):
        if data.get(key) is not None:
            numbers[f"sweep/{key}"] = data[key]
    sink.log_metrics(numbers, step=data["n_trials"])
    sink.set_tags({"sweep.best_trial": data["best"].get("number", ""), "sweep.states": data["states"]})
    sink.log_artifact(str(out_dir), artifact_path="sweep")
    sink.close()


@workflow
def ppo_sweep(cfg: PPOConfig = SWEEP_CFG, sweep: SweepConfig = DEFAULT_SWEEP) -> Swept:
    """Data and starting policy once, then batches of parallel trials until `sweep.n_trials`;
    returns the summary and the best trial's config file."""
    checked = check_config(cfg=cfg)
    run = start_sweep(cfg=checked, sweep=sweep)
    data = prepare_data(cfg=checked)
    base = prepare_policy(model=checked.model, seed=checked.trainer.seed, sft=data.sft)
    fitted = fit_prompts(cfg=checked, train=data.train, val=data.val, policy=base)
    told = sweep_batches(cfg=checked, sweep=sweep, run=run, train=fitted.train, val=fitted.val, base_model=base,
                         told=0)
    return finish_sweep(cfg=checked, sweep=sweep, run=run, told=told)
