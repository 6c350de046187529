"""What a sweep leaves behind: the summary (best trial against the default config's own
trial, the confirm table and its decision), the recommended config as a YAML file for
`ppo_pipeline --cfg`, and the plots for the console's decks (Optuna's, and each confirmed
config's val curves per seed).
"""

from __future__ import annotations

import html
import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

import yaml

from rlhf.config.schema import PPOConfig, to_dict
from sweeps.budget import rounds_spent
from sweeps.confirm import Confirmed
from sweeps.space import apply
from sweeps.steps import DEFAULT_ATTR


def best_trial(study):
    """The best finished trial: the study's best (one objective), or on the Pareto front the
    trial with the highest val score (two objectives); None before any trial completed."""
    complete = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    if not complete:
        return None
    if len(study.directions) == 1:
        return study.best_trial
    return max(study.best_trials, key=lambda t: t.values[0])


def default_trial(study):
    """The trial that ran the base config's own values (the first one, if run twice)."""
    return next((t for t in study.get_trials(deepcopy=False) if t.user_attrs.get(DEFAULT_ATTR)), None)


def trial_summary(t) -> dict[str, Any]:
    if t is None:
        return {}
    return {"number": t.number, "state": t.state.name, "params": dict(t.params),
            "values": list(t.values) if t.values else [],
            "final_val": t.user_attrs.get("final_val"), "best_val": t.user_attrs.get("best_val"),
            "kl_budget": t.user_attrs.get("kl_budget"), "stop_reason": t.user_attrs.get("stop_reason")}


def summary(study, first_number: int = 0) -> dict[str, Any]:
    """Counts by state, the best and the default trial, and their val scores side by side;
    `first_number` is the first trial of this launch (earlier ones came from relaunches)."""
    trials = study.get_trials(deepcopy=False)
    states: dict[str, int] = {}
    for t in trials:
        states[t.state.name] = states.get(t.state.name, 0) + 1
    best, default = best_trial(study), default_trial(study)
    out = {"study": study.study_name, "directions": [d.name.lower() for d in study.directions],
           "n_trials": len(trials), "launched": sum(t.number >= first_number for t in trials),
           "states": states, "best": trial_summary(best), "default": trial_summary(default),
           "rounds_spent": rounds_spent(trials, first_number)}
    if len(study.directions) == 2:
        out["pareto_front"] = sorted(t.number for t in study.best_trials)
    b, d = out["best"].get("final_val"), out["default"].get("final_val")
    out["best_val_score"], out["default_val_score"] = b, d
    out["best_minus_default"] = (b - d) if b is not None and d is not None else None
    return out


def best_config(study, base: PPOConfig) -> Optional[PPOConfig]:
    best = best_trial(study)
    return apply(base, best.params) if best is not None else None


def chosen_config(study, base: PPOConfig, confirmed: Confirmed) -> tuple[Optional[PPOConfig], str, str]:
    """(config, what it is, why) for best_config.yaml: the confirm phase's winner (a trial,
    or the default config when no trial beat it), or without a confirm phase the best trial."""
    if not confirmed.rows:
        best = best_trial(study)
        if best is None:
            return None, "", "no trial completed"
        return apply(base, best.params), f"best trial {best.number}", f"{confirmed.reason}; the best trial as run"
    if confirmed.winner_trial < 0:
        return base, "default", confirmed.reason
    return apply(base, study.trials[confirmed.winner_trial].params), confirmed.winner, confirmed.reason


def confirm_summary(confirmed: Confirmed) -> dict[str, Any]:
    return asdict(confirmed)


def confirm_metrics(confirmed: Confirmed) -> dict[str, float]:
    """sweep/confirm/<label>/{mean,se,n} for the parent MLflow run ("trial 3" -> "trial_3")."""
    out = {}
    for row in confirmed.rows:
        key = row.label.replace(" ", "_")
        out.update({f"sweep/confirm/{key}/mean": row.mean, f"sweep/confirm/{key}/se": row.se,
                    f"sweep/confirm/{key}/n": float(row.n)})
    return out


def confirm_table_html(confirmed: Confirmed) -> str:
    """The confirm table (one row per config: params, mean +- SE, n, each seed's score) and
    the decision, as an HTML fragment."""
    head = "<tr><th>config</th><th>params</th><th>mean</th><th>SE</th><th>n</th><th>scores by seed</th></tr>"
    rows = []
    for r in confirmed.rows:
        params = ", ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in sorted(r.params.items()))
        scores = ", ".join(f"{s}: {x:.4f}" for s, x in zip(r.seeds, r.scores))
        failed = f" (failed: {r.failed_seeds})" if r.failed_seeds else ""
        mark = " <b>(chosen)</b>" if r.label == confirmed.winner else ""
        rows.append(f"<tr><td>{html.escape(r.label)}{mark}</td><td>{html.escape(params)}</td><td>{r.mean:.4f}</td>"
                    f"<td>{r.se:.4f}</td><td>{r.n}</td><td>{html.escape(scores + failed)}</td></tr>")
    return (f"<h3>Confirm phase: objective {html.escape(confirmed.objective)}</h3><table>{head}{''.join(rows)}"
            f"</table><p>{html.escape(confirmed.reason)}</p>")


def confirm_figure(confirmed: Confirmed):
    """Each confirmed config's val curve per seed (val score after each round), one colour per config."""
    import plotly.graph_objects as go
    from plotly.colors import qualitative

    fig = go.Figure()
    for i, row in enumerate(confirmed.rows):
        colour = qualitative.Plotly[i % len(qualitative.Plotly)]
        for seed, curve in zip(row.seeds, row.curves):
            fig.add_trace(go.Scatter(x=list(range(1, len(curve) + 1)), y=curve, mode="lines+markers",
                                     name=f"{row.label} seed {seed}", legendgroup=row.label,
                                     line={"color": colour}))
    fig.update_layout(title=f"Confirm runs: val score per round (chosen: {confirmed.winner})",
                      xaxis_title="round", yaxis_title="val score")
    return fig


def write_atomic(path: Path, text: str) -> Path:
    """Write `text` to `path` through a temporary file in the same directory and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_config_yaml(cfg: PPOConfig, path: Path, header: str = "") -> Path:
    """The whole config as YAML (what `load_config` and `ppo_pipeline --cfg` read)."""
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    return write_atomic(path, comment + yaml.safe_dump(to_dict(cfg), sort_keys=False))


def write_summary_json(data: dict[str, Any], path: Path) -> Path:
    return write_atomic(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


# ---------------------------------------------------------------------------------
# Plots (optuna.visualization, plotly)
# ---------------------------------------------------------------------------------


def figures(study) -> dict[str, Any]:
    """Deck title -> plotly figure: optimization history and parallel coordinates once a
    trial completed; parameter importances with >= 2 completed trials whose params and
    values vary (fANOVA has nothing to split otherwise); the Pareto front with two objectives."""
    from optuna import visualization as vis

    complete = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    if not complete:
        return {}
    two = len(study.directions) == 2
    target = {"target": (lambda t: t.values[0]), "target_name": "val score"} if two else {}
    out = {"optimization history": vis.plot_optimization_history(study, **target),
           "parallel coordinates": vis.plot_parallel_coordinate(study, **target)}
    if len(complete) >= 2 and _varies(complete):
        out["parameter importances"] = vis.plot_param_importances(study, **target)
    if two:
        out["pareto front"] = vis.plot_pareto_front(study, target_names=["val score", "mean KL"])
    return out


def _varies(trials) -> bool:
    names = {k for t in trials for k in t.params}
    params = any(len({repr(t.params.get(k)) for t in trials}) > 1 for k in names)
    return params and all(len({t.values[i] for t in trials}) > 1 for i in range(len(trials[0].values)))


def figure_html(fig, with_plotly_js: bool) -> str:
    """A figure as an HTML fragment; the plotly library is inlined only where asked (once per
    page), so the decks work without network access."""
    return fig.to_html(full_html=False, include_plotlyjs=bool(with_plotly_js))
