"""Stage times, tokens/s and MFU of timed PPO update steps (benchmarks/update_throughput.py
and its TRL lane, benchmarks/update_trl.py)."""

from __future__ import annotations


def summarize(steps: list[dict], tokens: float, resp_tokens: float, world: int, n_actor: int, n_critic: int,
              n_embed: int, peak: float, epochs: int = 1) -> dict:
    """Median stage times over timed steps; tokens/s and MFU (6 N T per pass over the batch for
    a trained model, `epochs` passes; 2 N T for a forward-only pass; N the parameters that
    multiply per token)."""
    import statistics

    keys = steps[0]["times_s"].keys()
    t = {k: statistics.median(s["times_s"][k] for s in steps) for k in keys}
    peak_gb = {k: max(s["peak_gb"].get(k, 0.0) for s in steps) for k in keys}
    out = {"stage_time_s": t, "stage_peak_allocated_gb": peak_gb, "steps_timed": len(steps),
           "stage_alloc_retries": [s.get("alloc_retries", {}) for s in steps],
           "tokens_per_step": tokens, "response_tokens_per_step": resp_tokens,
           "tokens_per_s": tokens / t["total"], "tokens_per_s_per_gpu": tokens / t["total"] / world,
           "losses": [{"pg_loss": s["pg_loss"], "vf_loss": s["vf_loss"]} for s in steps]}
    if peak:
        n_critic_mm = max(n_critic - n_embed, 0)  # the critic's embedding is a lookup, it has no LM head
        flops = {
            "update_actor": 6 * n_actor * tokens * epochs, "old_log_prob": 2 * n_actor * tokens,
            "ref": 2 * n_actor * tokens, "values": 2 * n_critic_mm * tokens if n_critic else 0,
            "update_critic": 6 * n_critic_mm * tokens * epochs,
        }
        out["mfu_actor"] = flops["update_actor"] / t["update_actor"] / world / peak
        # the LM head only over response positions, as the fused path computes it
        needed = 6 * ((n_actor - n_embed) * tokens + n_embed * resp_tokens) * epochs
        out["mfu_actor_needed_flops"] = needed / t["update_actor"] / world / peak
        if n_critic and t.get("update_critic", 0) > 0:
            out["mfu_critic"] = flops["update_critic"] / t["update_critic"] / world / peak
        out["mfu_step"] = sum(flops[k] for k in flops if k in t and t[k] > 0) / t["total"] / world / peak
    return out
