"""A sweep's steps between the Optuna study and the PPO runs, as plain functions that the
Flyte workflow (`sweeps/sweep.py`) calls: check the sweep, plan a batch (ask within the
round budget, build each trial's config), turn a trial's final state into its Optuna
result, tell the batch, plan and score the confirm phase's re-runs, and keep one MLflow
parent run per sweep with a nested run per trial and per confirm run.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from rlhf.config.load import replace
from rlhf.config.schema import ConfigError, PPOConfig, flatten
from rlhf.config.keys import check_keys, from_json_checked
from rlhf.round.state import RoundState
from rlhf.tracking.study import set_trial_attr, stored_trial
from rlhf.tracking.trial import is_pruned
from rlhf.train import stateless as P
from sweeps.budget import ROUNDS_ATTR
from sweeps.confirm import DEFAULT_LABEL, ConfirmRow, ConfirmRun, ConfirmSpec, check_confirm, make_row
from sweeps.objective import check_objective, convergence_metrics, objective, pareto_objectives, val_curve
from sweeps.space import ParamSpec, apply, check_space, default_space
from sweeps.study import StudySpec, ask_batch, tell_batch
from rlhf.tracking.buffer import BufferedMLflowSink
from rlhf.tracking.make import make_sink

log = logging.getLogger(__name__)

DEFAULT_ATTR = "default_config"  # user attr of the trial that runs the base config's own values
# Sections a sweep prepares once for all its trials (dataset, starting policy).
SHARED_SECTIONS = ("data.", "model.")


@dataclass(frozen=True)
class SweepConfig:
    study: StudySpec = field(default_factory=StudySpec)
    n_trials: int = 8  # most trials this launch adds to the study (a relaunch adds more)
    batch_size: int = 2  # trials asked, run in parallel and told together
    round_budget: int = 0  # most PPO rounds this launch's trials run in all (sweeps.budget); 0 => no limit
    space: list[ParamSpec] = field(default_factory=default_space)
    run_default: bool = True  # the base config's own values run once per study, as its first trial asked
    objective: str = "final_val"  # "final_val" | "auc" | "rounds_to_target" (sweeps.objective)
    kl_budget_weight: float = 0.5  # objective: penalty per unit of KL-budget violation
    divergence_penalty: float = 0.25  # objective: penalty when the run stopped for divergence
    score_threshold: float = 0.5  # val score that `steps_to_score` and `rounds_to_target` count to
    confirm: ConfirmSpec = field(default_factory=ConfirmSpec)  # re-runs of the top trials on fresh seeds

    @classmethod
    def from_json(cls, text: str) -> "SweepConfig":
        """What `pyflyte run sweeps/sweep.py ppo_sweep --sweep FILE|JSON` builds: an unknown
        key (e.g. `study.pruenr`, `space[1].hgih`) is a usage error, not silently dropped."""
        return from_json_checked(cls, text)

    @classmethod
    def __pre_deserialize__(cls, d: dict) -> dict:
        """The same key check when a task decodes a sweep input (console, flytectl launches)."""
        check_keys(d, "sweep input", cls=cls)
        return d


@dataclass
class Planned:
    """One asked trial: its number, sampled params and config (None when refused: `error`)."""

    number: int
    params: dict[str, Any]
    cfg: Optional[PPOConfig]
    error: str = ""
    is_default: bool = False


def check_sweep(sweep: SweepConfig) -> None:
    """Counts are positive and the space is valid for a sweep that shares data and policy."""
    if sweep.n_trials <= 0 or sweep.batch_size <= 0:
        raise ConfigError(f"sweep.n_trials ({sweep.n_trials}) and sweep.batch_size ({sweep.batch_size}) must be > 0")
    if not sweep.space:
        raise ConfigError("sweep.space is empty; give at least one parameter (see sweeps.space.default_space)")
    check_space(sweep.space)
    shared = [p.name for p in sweep.space if p.name.startswith(SHARED_SECTIONS)]
    if shared:
        raise ConfigError(f"sweep parameters {shared} change the dataset or the starting policy, which a sweep "
                          "prepares once for all its trials; set them in the sweep's cfg instead")
    if len(sweep.study.directions) not in (1, 2):
        raise ConfigError(f"sweep.study.directions must hold 1 or 2 directions, got {sweep.study.directions}")
    if sweep.round_budget < 0:
        raise ConfigError(f"sweep.round_budget ({sweep.round_budget}) must be >= 0 (0: no limit)")
    try:
        check_objective(sweep.objective)
    except ValueError as e:
        raise ConfigError(f"sweep.objective: {e}") from None


def check_sweep_for(sweep: SweepConfig, cfg: PPOConfig) -> None:
    """What depends on the base config too: the budget holds one trial's rounds, the
    confirm seeds are fresh."""
    check_sweep(sweep)
    rounds = cfg.trainer.total_rounds
    if 0 < sweep.round_budget < rounds:
        raise ConfigError(f"sweep.round_budget ({sweep.round_budget}) is below one trial's trainer.total_rounds "
                          f"({rounds}): no trial could run; raise the budget or lower total_rounds")
    if sweep.study.pruner == "hyperband" and sweep.study.max_resource > rounds:
        raise ConfigError(f"sweep.study.max_resource ({sweep.study.max_resource}) exceeds trainer.total_rounds "
                          f"({rounds}); set it to {rounds} or 0")
    try:
        check_confirm(sweep.confirm, cfg.trainer.seed)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def default_params(cfg: PPOConfig, space: list[ParamSpec]) -> dict[str, Any]:
    """The base config's own values of the swept keys (categorical values as their choice text)."""
    flat = flatten(cfg)
    return {p.name: str(flat[p.name]) if p.kind == "categorical" else flat[p.name] for p in space}


def enqueue_default(study, cfg: PPOConfig, space: list[ParamSpec]) -> bool:
    """Queue the base config's own trial unless the study has one; True when queued."""
    if any(t.user_attrs.get(DEFAULT_ATTR) for t in study.get_trials(deepcopy=False)):
        return False
    study.enqueue_trial(default_params(cfg, space), user_attrs={DEFAULT_ATTR: True})
    return True


def plan_batch(study, space: list[ParamSpec], base: PPOConfig, k: int) -> list[Planned]:
    """Ask `k` trials and build each one's config; a config the checks refuse is told FAIL
    at once (its error kept as a user attr) and comes back with `cfg=None`."""
    planned = []
    for number, params in ask_batch(study, space, k):
        attrs = stored_trial(study, number).user_attrs
        try:
            cfg, error = apply(base, params), ""
        except ConfigError as e:
            cfg, error = None, f"{type(e).__name__}: {e}"
        planned.append(Planned(number, params, cfg, error, bool(attrs.get(DEFAULT_ATTR))))
    refused = [p for p in planned if p.cfg is None]
    for p in refused:
        set_trial_attr(study, p.number, "error", p.error[:2000])
    tell_batch(study, [(p.number, "FAIL", []) for p in refused])
    return planned


def result_of(state: Optional[RoundState], cfg: PPOConfig, sweep: SweepConfig
              ) -> tuple[str, list[float], dict[str, Any]]:
    """(Optuna state, values, metrics) of a trial from its final state (None: it raised)."""
    if state is None:
        return "FAIL", [], {"error": "the trial's pipeline raised (see its execution)"}
    m = convergence_metrics(state.step_history, state.val_history, P.stop_reason(cfg, state),
                            cfg.algorithm.kl_ctrl.target_kl, sweep.score_threshold, cfg.trainer.total_rounds)
    metrics = {**asdict(m), ROUNDS_ATTR: state.round}
    if is_pruned(state.stop_reason):
        return "PRUNED", [], metrics
    if len(sweep.study.directions) == 1:
        values = [objective(m, sweep.kl_budget_weight, sweep.divergence_penalty, sweep.objective)]
    else:
        values = list(pareto_objectives(m))
    if not all(math.isfinite(v) for v in values):
        return "FAIL", [], {**metrics, "error": f"non-finite objective {values}"}
    return "COMPLETE", values, metrics


def tell(study, numbers: list[int], cfgs: list[PPOConfig], states: list[Optional[RoundState]],
         sweep: SweepConfig) -> list[tuple[int, str, list[float], dict[str, Any]]]:
    """Tell each trial its result, with its convergence metrics as user attrs; returns
    (number, state, values, metrics) per trial."""
    out = []
    for number, cfg, state in zip(numbers, cfgs, states, strict=True):
        status, values, metrics = result_of(state, cfg, sweep)
        if not stored_trial(study, number).state.is_finished():
            for key, value in metrics.items():
                set_trial_attr(study, number, key, value)
        out.append((number, status, values, metrics))
    tell_batch(study, [(n, s, v) for n, s, v, _ in out])
    return out


def confirm_candidates(study, k: int) -> list:
    """The top `k` complete trials by their (first) objective, the default config's trial left
    out (the confirm phase re-runs the base config anyway)."""
    complete = [t for t in study.get_trials(deepcopy=False)
                if t.state.name == "COMPLETE" and not t.user_attrs.get(DEFAULT_ATTR)]
    sign = 1.0 if study.directions[0].name == "MAXIMIZE" else -1.0
    return sorted(complete, key=lambda t: (-sign * t.values[0], t.number))[:k]


def plan_confirm(study, base: PPOConfig, sweep: SweepConfig) -> tuple[list[ConfirmRun], list[PPOConfig]]:
    """The confirm phase's runs (the default config, then the top trials, each on every
    confirm seed) and their configs; none when `sweep.confirm.k` is 0."""
    spec = sweep.confirm
    if spec.k <= 0:
        return [], []
    configs = [(DEFAULT_LABEL, -1, default_params(base, sweep.space))]
    configs += [(f"trial {t.number}", t.number, dict(t.params)) for t in confirm_candidates(study, spec.k)]
    rounds = spec.rounds or base.trainer.total_rounds
    runs, cfgs = [], []
    for label, number, params in configs:
        for seed in spec.seeds:
            runs.append(ConfirmRun(label=label, trial=number, seed=seed, params={k: repr(v) for k, v in params.items()}))
            cfgs.append(replace(apply(base, params), [f"trainer.seed={seed}", f"trainer.total_rounds={rounds}"]))
    return runs, cfgs


def confirm_rows(runs: list[ConfirmRun], cfgs: list[PPOConfig], states: list[Optional[RoundState]],
                 sweep: SweepConfig) -> list[ConfirmRow]:
    """One row per config (in plan order): each seed's objective, final val score and val
    curve; a run that raised (None) is listed under `failed_seeds`."""
    results: dict[tuple[str, int], list] = {}
    params: dict[tuple[str, int], dict[str, str]] = {}
    for run, cfg, state in zip(runs, cfgs, states, strict=True):
        key = (run.label, run.trial)
        params[key] = run.params
        results.setdefault(key, []).append((run.seed, _scored(state, cfg, sweep)))
    return [make_row(label, trial, params[(label, trial)], res) for (label, trial), res in results.items()]


def _scored(state: Optional[RoundState], cfg: PPOConfig, sweep: SweepConfig) -> Optional[tuple]:
    if state is None:
        return None
    rounds = cfg.trainer.total_rounds
    m = convergence_metrics(state.step_history, state.val_history, P.stop_reason(cfg, state),
                            cfg.algorithm.kl_ctrl.target_kl, sweep.score_threshold, rounds)
    score = objective(m, sweep.kl_budget_weight, sweep.divergence_penalty, sweep.objective)
    return score, m.final_val, val_curve(state.val_history, rounds)


# ---------------------------------------------------------------------------------
# MLflow: one parent run per sweep launch, a nested run per trial
# ---------------------------------------------------------------------------------


def open_parent_run(cfg: PPOConfig, sweep: SweepConfig, storage: str) -> str:
    """The sweep's MLflow run (its settings as params) when `trainer.logger` lists mlflow; else ""."""
    if "mlflow" not in cfg.trainer.logger:
        return ""
    sink = mlflow_sink(cfg, run_name=f"sweep {sweep.study.name}", tags={"sweep.study": sweep.study.name})
    sink.log_params({"sweep.study": sweep.study.name, "sweep.storage": _hide_password(storage),
                     "sweep.n_trials": sweep.n_trials, "sweep.batch_size": sweep.batch_size,
                     "sweep.round_budget": sweep.round_budget, "sweep.objective": sweep.objective,
                     "sweep.confirm": asdict(sweep.confirm),
                     "sweep.sampler": sweep.study.sampler, "sweep.pruner": sweep.study.pruner,
                     "sweep.directions": sweep.study.directions,
                     "sweep.space": [asdict(p) for p in sweep.space]})
    return sink.run_id


def open_trial_run(p: Planned, parent_run_id: str, study_name: str) -> str:
    """A nested MLflow run for a trial (its whole config as params), or "" without a parent."""
    if not parent_run_id or p.cfg is None:
        return ""

    sink = make_sink(["mlflow"], p.cfg, run_name=f"{study_name} trial {p.number}", parent_run_id=parent_run_id)
    sink.set_tags({"sweep.study": study_name, "sweep.trial": p.number, "sweep.default": p.is_default,
                   "sweep.params": json.dumps(p.params, sort_keys=True)})
    return sink.run_id


def open_confirm_run(run: ConfirmRun, cfg: PPOConfig, parent_run_id: str, study_name: str) -> str:
    """A nested MLflow run for one confirm re-run, or "" without a parent."""
    if not parent_run_id:
        return ""

    sink = make_sink(["mlflow"], cfg, run_name=f"{study_name} confirm {run.label} seed {run.seed}",
                     parent_run_id=parent_run_id)
    sink.set_tags({"sweep.study": study_name, "sweep.confirm": run.label, "sweep.confirm_seed": run.seed,
                   "sweep.trial": run.trial, "sweep.params": json.dumps(run.params, sort_keys=True)})
    return sink.run_id


def close_trial_run(cfg: PPOConfig, run_id: str, status: str, values: list[float], metrics: dict[str, Any]) -> None:
    """The trial's result into its nested run, which ends FINISHED, KILLED (pruned) or FAILED."""
    if not run_id:
        return
    sink = mlflow_sink(cfg, run_id=run_id)
    numbers = {f"sweep/{k}": float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
    numbers.update({f"sweep/objective_{i}": v for i, v in enumerate(values)})
    if numbers:
        sink.log_metrics(numbers, step=int(metrics.get("steps", 0)))
    sink.set_tags({"sweep.state": status, **({"sweep.error": metrics["error"]} if "error" in metrics else {})})
    sink.close({"COMPLETE": "FINISHED", "PRUNED": "KILLED"}.get(status, "FAILED"))


def mlflow_sink(cfg: PPOConfig, **run):
    """The engine's MLflow sink for a sweep run (`run_id` resumes one): buffered under
    `trainer.output_dir` while the server does not answer, so the sweep never waits on it."""
    t = cfg.trainer
    return BufferedMLflowSink(os.path.join(t.output_dir, "mlflow_buffer"), t.mlflow_tracking_uri, t.project_name,
                              output_dir=t.output_dir, **run)


def _hide_password(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)
