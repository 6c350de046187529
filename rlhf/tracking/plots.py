"""Training curves from a `RoundState`, as a matplotlib figure and as self-contained HTML.

Panels over PPO steps: validation score, train reward, KL to the reference with the KL
coefficient, policy and value loss, entropy, clip fraction and response length; the
figure's title carries the stop reason. The HTML embeds the figure as a PNG so that it
renders anywhere (a Flyte deck, a browser, a CI artifact).
"""

from __future__ import annotations

import base64
import html
import io

from rlhf.round.state import RoundState

# (panel title, [(history key, label)], second-axis (key, label) or None)
PANELS: tuple[tuple[str, tuple[tuple[str, str], ...], tuple[str, str] | None], ...] = (
    ("train reward", (("critic/score/mean", "score mean"),), None),
    ("KL to reference", (("actor/current_kl", "KL"),), ("actor/reward_kl_penalty_coeff", "kl_coef")),
    ("losses", (("actor/pg_loss", "policy loss"), ("critic/vf_loss", "value loss")), None),
    ("entropy", (("actor/entropy", "entropy"),), None),
    ("clip fraction", (("actor/pg_clipfrac", "pg_clipfrac"),), None),
    ("response length", (("response_length/mean", "tokens (mean)"),), None),
    ("grad norm", (("actor/grad_norm", "actor"),), None),
)


def _series(state: RoundState, key: str) -> tuple[list[float], list[float]]:
    rows = [r for r in state.step_history if key in r]
    return [r["step"] for r in rows], [r[key] for r in rows]


def training_figure(state: RoundState, stop_reason: str = ""):
    """A 2 x 4 grid: validation score first, then the `PANELS`."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(16, 7))
    # Fixed margins: a layout engine would double the drawing time (~0.4 s -> 0.8 s).
    fig.subplots_adjust(left=0.04, right=0.96, top=0.9, bottom=0.08, wspace=0.45, hspace=0.35)
    axes = fig.subplots(2, 4).flatten()
    ax = axes[0]
    ax.plot([v["step"] for v in state.val_history], [v["score"] for v in state.val_history], "o-", color="C2")
    ax.set_title("validation score")
    for ax, (title, lines, twin) in zip(axes[1:], PANELS):
        for i, (key, label) in enumerate(lines):
            ax.plot(*_series(state, key), ".-", color=f"C{i}", label=label)
        if twin:
            ax2 = ax.twinx()
            ax2.plot(*_series(state, twin[0]), "--", color="C3", label=twin[1])
            ax2.set_ylabel(twin[1], color="C3")
            ax.set_ylabel(lines[0][1], color="C0")
        if len(lines) > 1:
            ax.legend(loc="best", fontsize="small")
        ax.set_title(title)
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(f"round {state.round}, step {state.global_step}"
                 + (f" | stopped: {stop_reason}" if stop_reason else ""))
    return fig


def figure_png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    return buf.getvalue()


def _score(x: float) -> str:
    return f"{x:.4f}" if x >= 0 else "n/a"  # -1 marks "not measured yet" in RoundState


def training_html(state: RoundState, stop_reason: str = "") -> str:
    """The curves as an embedded PNG, with the stop reason and the latest values as text."""
    png = base64.b64encode(figure_png(training_figure(state, stop_reason))).decode()
    last = state.step_history[-1] if state.step_history else {}
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{v:.5g}</td></tr>" for k, v in sorted(last.items()))
    reason = html.escape(stop_reason or "(none: still running, or ran all rounds)")
    return (f'<div class="rlhf-training">'
            f'<p class="stop-reason"><b>stop reason:</b> {reason}</p>'
            f'<p><b>best val score:</b> {_score(state.best_val)} (start {_score(state.val_start)}, '
            f'last {_score(state.last_val)}); <b>kl_coef:</b> {state.kl_coef:.5g}</p>'
            f'<img class="training-curves" alt="training curves" src="data:image/png;base64,{png}"/>'
            f'<table class="last-step"><tr><th>metric (last step)</th><th>value</th></tr>{rows}</table></div>')


def metrics_html(metrics: dict[str, float], title: str = "") -> str:
    """A flat metrics dict as a two-column HTML table (cheap: no figure)."""
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{v:.5g}</td></tr>" for k, v in sorted(metrics.items()))
    head = f"<p><b>{html.escape(title)}</b></p>" if title else ""
    return f'<div class="rlhf-metrics">{head}<table><tr><th>metric</th><th>value</th></tr>{rows}</table></div>'
