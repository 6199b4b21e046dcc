"""Rates and ratios of ``bench.gpu.workload``'s sides: per-run samples/s and tokens/s (whole run and steady state),
ours over TRL's per shape, and a one-line description of a side. Pure functions of the recorded figures, shared
by the benchmark and the report (which recomputes ratios from older files too)."""

from __future__ import annotations

from typing import Any


def rates(marks: list[float], per_step: int, tokens: list[float], wall: float, skip: int) -> dict[str, Any]:
    """Whole-run and steady-state rates from step end times (seconds from the start) and completion tokens per
    step."""
    samples = len(marks) * per_step
    out = {"steps": len(marks), "samples": samples, "wall_s": wall, "samples_per_s": samples / wall,
           "completion_tokens": sum(tokens), "completion_tokens_per_s": sum(tokens) / wall,
           "completion_len_mean": sum(tokens) / max(1, samples), "step_end_s": marks}
    if len(marks) > skip >= 1:
        span = marks[-1] - marks[skip - 1]
        out["samples_per_s_steady"] = (len(marks) - skip) * per_step / span
        out["completion_tokens_per_s_steady"] = sum(tokens[skip:]) / span
    return out


def summarise(results: dict[str, Any]) -> dict[str, Any]:
    """Ours over TRL's, per shape: trained samples/s (whole run and steady) and completion tokens/s (``_tokens``)
    for each pairing that ran. Both matter: a side that trains shorter completions (streaming producers hand the
    learner the groups that finish first, and drop stale ones, which run long) gains samples/s that tokens/s
    does not show."""
    out: dict[str, Any] = {}
    pairs = [("async", "trl"), ("async", "trl_sleep"), ("sync", "trl"), ("sync", "trl_sleep"),
             ("async", "trl_async"), ("async", "sync"), ("async_fp8", "async"), ("async_lora", "sync_lora"),
             ("async_lora", "trl_lora"), ("sync_lora", "trl_lora")]
    for shape, r in results.items():
        if shape == "summary" or not isinstance(r, dict):  # a result file's own summary: not a shape
            continue
        mine = r.get("ours", {})
        for a, b in pairs:
            x, y = mine.get(a), mine.get(b) or r.get(b)
            if not x or not y or "samples_per_s" not in x or "samples_per_s" not in y:
                continue
            partial = x.get("partial") or y.get("partial")  # a side cut short: its steps so far, kept apart
            key = f"{shape}/{a}_over_{b}" + ("_partial" if partial else "")
            out[key] = x["samples_per_s"] / y["samples_per_s"]
            out[key + "_tokens"] = x["completion_tokens_per_s"] / y["completion_tokens_per_s"]
            if not partial and "samples_per_s_steady" in x and "samples_per_s_steady" in y:
                out[key + "_steady"] = x["samples_per_s_steady"] / y["samples_per_s_steady"]
        for key in ("generation_limit_ratio", "generation_limit_ratio_lora"):
            if key in mine:
                out[f"{shape}/{key}"] = mine[key]
    return out


# TRL's single-GPU sides, as the report names them.
TRL_LABELS = {"trl": "TRL GRPOTrainer, vLLM colocate", "trl_sleep": "TRL, vLLM colocate + sleep mode"}


def fastest_trl(shape_results: dict[str, Any]) -> str | None:
    """TRL's fastest single-GPU side that ran in one shape's results (the goal is set against it), or None.
    A side that failed carries an error and no rates: it is not a candidate."""
    ran = [m for m in TRL_LABELS if isinstance(shape_results.get(m), dict) and "samples_per_s" in shape_results[m]]
    return max(ran, key=lambda m: shape_results[m]["samples_per_s"]) if ran else None


def over_fastest_trl(results: dict[str, Any], shape: str) -> tuple[str, float, float] | None:
    """(TRL side, samples/s ratio, tokens/s ratio) of ours async over TRL's fastest side in ``shape``."""
    trl, ratios = fastest_trl(results.get(shape, {})), summarise(results)
    key = f"{shape}/async_over_{trl}"
    return (trl, ratios[key], ratios[key + "_tokens"]) if trl and key in ratios else None


def describe(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"failed: {r['error'][:300]}"
    if "tokens_per_s" in r:
        return f"{r['tokens_per_s']:.0f} tokens/s alone"
    return (f"{r['samples']} samples in {r['wall_s']:.1f}s = {r['samples_per_s']:.1f}/s "
            f"(steady {r.get('samples_per_s_steady', float('nan')):.1f}/s), "
            f"{r['completion_tokens_per_s']:.0f} completion tokens/s, mean length {r['completion_len_mean']:.0f}")
