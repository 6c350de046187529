"""The hyperparameter sweep: Optuna over PPO's `kl_coef`, `clip_ratio` and `entropy_coeff`
(or any config keys), as a Flyte workflow.

    pyflyte run sweeps/sweep.py ppo_sweep                         # embedded default, CPU
    pyflyte run sweeps/sweep.py ppo_sweep --cfg my.yaml --sweep sweep.yaml

The dataset and the starting policy are prepared once; then `sweep_batches` (a `@dynamic`)
asks `batch_size` trials from the study, runs them as parallel `ppo_trial` sub-workflows
(the PPO rounds on each trial's config, its `decide` step reporting to the study's pruner:
successive halving gives the promising trials more rounds), tells their results back, and
recurses, so the sampler always sees finished trials, until `n_trials` or the round budget
is spent. A trial that raises comes back empty from the failure-tolerant array node and is
told FAIL. `confirm_phase` (a `@dynamic`) then re-runs the top trials and the default config
on fresh seeds, in parallel over the same launch plan, and decides the recommended config.
The study lives in an RDB storage (SQLite under `trainer.output_dir` by default; a
PostgreSQL URL in `sweep.study.storage` when trials run in other pods), so relaunching
with the same study name continues it. With mlflow in `trainer.logger` every launch has
one parent run and a nested run per trial. `finish_sweep` writes the summary and the confirmed
config (`--cfg` for `workflows/ppo.py ppo_pipeline`) and shows the Optuna plots and the
confirm table with each confirmed config's val curves per seed.
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
from rlhf.config.load import load_config
from rlhf.config.schema import PPOConfig
from rlhf.round.state import RoundState
from sweeps import report as R
from sweeps.budget import next_batch_size, rounds_spent
from sweeps.confirm import DEFAULT_LABEL, ConfirmRow, ConfirmRun, ConfirmSpec, Confirmed, decide
from sweeps.steps import (SweepConfig, check_sweep_for, close_trial_run, confirm_rows, enqueue_default, mlflow_sink,
                          open_confirm_run, open_parent_run, open_trial_run, plan_batch, plan_confirm, tell)
from sweeps.study import StudySpec, open_study, storage_url
from rlhf.tracking.trial import TrialContext
from tasks.base import CPU_SMALL, DECK_FIELDS, TRACKING_SECRETS, Prompts
from tasks.data import fit_prompts, prepare_policy, rounds_from_epochs
from tasks.run import check_config, report
from workflows.ppo import ppo_rounds, prepare_data

# The embedded default: the tiny arithmetic task on a short schedule. Everything the sweep's
# wall time depends on is set here rather than taken from the library defaults. The SFT
# warm-start is the library default's (its step cap sits well past the phase change on every
# seed and numeric variant measured, benchmarks/results/sft_reliability_*.json): a shorter cap
# here once ended the warm-start before the phase change on another machine.
# Segments of one round: the pruner hears every round's val score (it hears a segment's
# last one, between segments). The KL budget is the library's (target_kl 1.0, ceiling 2.0):
# at 0.1 / 0.2 most trials stopped on KL within 8 rounds, and the divergence penalty, not the
# val curve, then decided their scores.
SHORT_SCHEDULE = [
    "trainer.total_rounds=8", "trainer.rounds_per_segment=1", "trainer.test_freq=1", "trainer.val_before_train=false",
    "trainer.logger=[mlflow]", "trainer.seed=0",
    "data.synthetic.n_train=4000", "data.synthetic.n_val=200",
    "data.train_batch_size=64", "rollout.n=4", "actor.ppo_mini_batch_size=16",
    "rollout.temperature=1.0",
]
SWEEP_CFG = load_config(None, SHORT_SCHEDULE)
# Successive halving with rungs at rounds 2 and 4 (val scores after one round differ by less
# than the val set's noise): half the trials at a rung go on, the rest stop. 96 rounds for
# the search (a trial runs 2, 4 or 8), then the default config and the top 2 trials on 3
# fresh seeds of 8 rounds (72 rounds): about 170 rounds at about 9 s each with 2 at a time,
# some 30 minutes on 2 cores. The objective is the area under the val curve, which averages
# the noise of 8 val measurements and prefers configs that get there sooner.
DEFAULT_SWEEP = SweepConfig(study=StudySpec(name="ppo-sweep-tiny", pruner="sha", min_resource=2, reduction_factor=2),
                            n_trials=32, batch_size=2, round_budget=96, objective="auc",
                            confirm=ConfirmSpec(k=2, seeds=[1001, 1002, 1003]))
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
    best_config: str = ""  # path of the recommended config's YAML
    objective: str = ""  # the sweep's objective (sweeps.objective.OBJECTIVES)
    round_budget: int = 0
    rounds_spent: int = 0  # PPO rounds this launch's trials ran (the confirm runs not counted)
    confirm: list[ConfirmRow] = field(default_factory=list)  # the confirm table
    chosen: str = ""  # what best_config.yaml holds: "default", "trial N", or "best trial N" (no confirm)
    chosen_reason: str = ""
    wall_s: float = 0.0


Swept = NamedTuple("Swept", [("summary", SweepSummary), ("best_config", Optional[FlyteFile])])


@task(requests=CPU_SMALL, container_image=CPU_IMAGE, retries=2, secret_requests=TRACKING_SECRETS)
def start_sweep(cfg: PPOConfig, sweep: SweepConfig) -> SweepRun:
    """Check the sweep, open (or continue) its study, queue the default config's own trial
    once per study, and open the launch's MLflow parent run."""
    check_sweep_for(sweep, cfg)
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
    round's val score to the study (pruned trials stop early); returns the final state. A
    confirm run is the same with `trial.number` -1: it reports nothing and is never pruned."""
    checked = check_config(cfg=cfg)
    rounds = ppo_rounds(cfg=checked, train=train, val=val, base_model=base_model, run_id=run_id, trial=trial)
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
    study = open_study(sweep.study, run.storage)
    spent = rounds_spent(study.get_trials(deepcopy=False), run.first_number)
    k = next_batch_size(sweep.batch_size, sweep.n_trials - told, sweep.round_budget, spent, cfg.trainer.total_rounds)
    if k == 0:
        return told
    planned = [p for p in plan_batch(study, sweep.space, cfg, k) if p.cfg]
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


@task(requests=CPU_SMALL, container_image=CPU_IMAGE, secret_requests=TRACKING_SECRETS)
def score_confirm(sweep: SweepConfig, runs: list[ConfirmRun], cfgs: list[PPOConfig], run_ids: list[str],
                  states: list[Optional[RoundState]]) -> Confirmed:
    """The confirm table (mean and standard error of the objective per config over the fresh
    seeds) and the decision: a trial that beats the default by more than z SE, or the default."""
    rows = confirm_rows(runs, cfgs, states, sweep)
    scores = {(row.label, seed): score for row in rows for seed, score in zip(row.seeds, row.scores)}
    for r, cfg, run_id in zip(runs, cfgs, run_ids, strict=True):
        score = scores.get((r.label, r.seed))
        close_trial_run(cfg, run_id, "FAIL" if score is None else "COMPLETE", [] if score is None else [score], {})
    winner, reason = decide(rows, sweep.confirm.z)
    return Confirmed(objective=sweep.objective, rows=rows, winner=winner.label if winner else DEFAULT_LABEL,
                     winner_trial=winner.trial if winner else -1, reason=reason)


@dynamic(requests=CPU_SMALL, container_image=CPU_IMAGE, secret_requests=TRACKING_SECRETS)
def confirm_phase(cfg: PPOConfig, sweep: SweepConfig, run: SweepRun, train: Prompts, val: Prompts,
                  base_model: FlyteDirectory, told: int) -> Confirmed:
    """After the last batch (`told`): the default config and the top `sweep.confirm.k` trials,
    each on every confirm seed, as parallel `ppo_trial` runs outside the study; then the table."""
    runs, cfgs = plan_confirm(open_study(sweep.study, run.storage), cfg, sweep)
    if not runs:
        return Confirmed(objective=sweep.objective, reason="no confirm phase (sweep.confirm.k is 0)")
    n = len(runs)
    outside = [TrialContext(study=sweep.study, storage=run.storage, number=-1)] * n
    run_ids = [open_confirm_run(r, c, run.parent_run_id, sweep.study.name) for r, c in zip(runs, cfgs)]
    states = map_task(ppo_trial_lp, concurrency=sweep.batch_size, min_success_ratio=MIN_SUCCESS_RATIO)(
        trial=outside, cfg=cfgs, run_id=run_ids, train=[train] * n, val=[val] * n, base_model=[base_model] * n)
    return score_confirm(sweep=sweep, runs=runs, cfgs=cfgs, run_ids=run_ids, states=states)


@task(requests=CPU_SMALL, container_image=CPU_IMAGE, enable_deck=True, deck_fields=DECK_FIELDS,
      secret_requests=TRACKING_SECRETS)
def finish_sweep(cfg: PPOConfig, sweep: SweepConfig, run: SweepRun, told: int, confirmed: Confirmed) -> Swept:
    """The summary (best trial against the default config's trial, the confirm table and its
    decision), the recommended config as YAML, the Optuna plots and the confirm table and
    curves as decks, and the parent MLflow run closed with them."""
    study = open_study(sweep.study, run.storage)
    data = R.summary(study, run.first_number)
    data.update(objective=sweep.objective, round_budget=sweep.round_budget, wall_s=time.time() - run.started_at)
    out_dir = Path(cfg.trainer.output_dir).resolve() / "sweeps" / sweep.study.name
    chosen_cfg, chosen, why = R.chosen_config(study, cfg, confirmed)
    data.update(confirm=R.confirm_summary(confirmed), chosen=chosen, chosen_reason=why)
    best_path = out_dir / "best_config.yaml"
    if chosen_cfg is not None:
        R.write_config_yaml(chosen_cfg, best_path, f"{chosen} of sweep '{sweep.study.name}': {why}")
        data["best_config"] = str(best_path)
    R.write_summary_json(data, out_dir / "summary.json")
    figs = R.figures(study)
    if confirmed.rows:
        figs["confirm curves"] = R.confirm_figure(confirmed)
        R.write_atomic(out_dir / "confirm_curves.html", R.figure_html(figs["confirm curves"], with_plotly_js=True))
        Deck("confirm", R.confirm_table_html(confirmed))
    for i, (title, fig) in enumerate(figs.items()):
        Deck(title, R.figure_html(fig, with_plotly_js=i == 0))
    _close_parent(cfg, run, data, out_dir, confirmed)
    return Swept(summary=_summary(data, told, confirmed),
                 best_config=FlyteFile(str(best_path)) if chosen_cfg else None)


def _summary(data: dict, told: int, confirmed: Confirmed) -> SweepSummary:
    best, default = data["best"], data["default"]
    return SweepSummary(
        study=data["study"], n_trials=data["n_trials"], launched=told, states=data["states"],
        best_trial=best.get("number", -1), best_params={k: repr(v) for k, v in best.get("params", {}).items()},
        best_values=best.get("values", []), best_val_score=_or(best.get("final_val"), -1.0),
        default_trial=default.get("number", -1), default_val_score=_or(default.get("final_val"), -1.0),
        best_config=data.get("best_config", ""), objective=data["objective"], round_budget=data["round_budget"],
        rounds_spent=data["rounds_spent"], confirm=confirmed.rows, chosen=data["chosen"],
        chosen_reason=data["chosen_reason"], wall_s=data["wall_s"])


def _or(value, fallback: float) -> float:
    return fallback if value is None else float(value)


def _close_parent(cfg: PPOConfig, run: SweepRun, data: dict, out_dir: Path, confirmed: Confirmed) -> None:
    if not run.parent_run_id:
        return
    sink = mlflow_sink(cfg, run_id=run.parent_run_id)
    numbers = {"sweep/n_trials": data["n_trials"], "sweep/wall_s": data["wall_s"],
               "sweep/rounds_spent": data["rounds_spent"], **R.confirm_metrics(confirmed)}
    for key in ("best_val_score", "default_val_score"):
        if data.get(key) is not None:
            numbers[f"sweep/{key}"] = data[key]
    sink.log_metrics(numbers, step=data["n_trials"])
    sink.set_tags({"sweep.best_trial": data["best"].get("number", ""), "sweep.states": data["states"],
                   "sweep.objective": data["objective"], "sweep.chosen": data["chosen"],
                   "sweep.chosen_reason": data["chosen_reason"][:5000]})
    sink.log_artifact(str(out_dir), artifact_path="sweep")
    sink.close()


@workflow
def ppo_sweep(cfg: PPOConfig = SWEEP_CFG, sweep: SweepConfig = DEFAULT_SWEEP) -> Swept:
    """Data and starting policy once, then batches of parallel trials until `sweep.n_trials` or
    the round budget, then the confirm phase; returns the summary and the recommended config."""
    checked = check_config(cfg=cfg)
    run = start_sweep(cfg=checked, sweep=sweep)
    data = prepare_data(cfg=checked)
    base = prepare_policy(model=checked.model, seed=checked.trainer.seed, sft=data.sft)
    fitted = fit_prompts(cfg=checked, train=data.train, val=data.val, policy=base)
    run_cfg = rounds_from_epochs(cfg=checked, train=fitted.train)  # trainer.total_epochs -> total_rounds
    told = sweep_batches(cfg=run_cfg, sweep=sweep, run=run, train=fitted.train, val=fitted.val, base_model=base,
                         told=0)
    confirmed = confirm_phase(cfg=checked, sweep=sweep, run=run, train=fitted.train, val=fitted.val, base_model=base,
                              told=told)
    return finish_sweep(cfg=checked, sweep=sweep, run=run, told=told, confirmed=confirmed)
