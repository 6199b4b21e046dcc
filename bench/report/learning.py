"""Sections on learning: does the recipe learn over seeds and machine numerics, sync vs async at equal samples,
and multi-turn tool use."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.report.format import num, pct, table


def demo_seeds(r: dict[str, Any]) -> list[str]:
    rows = [[name, pct(x["before"]), pct(x["after"]), f"{x['gain'] * 100:+.1f}", num(x["samples_per_s"], 0),
             num(x["total_s"], 0)] for name, x in r["runs"].items()]
    lines = table(["run", "held-out before", "after", "gain (points)", "samples/s", "run s"], rows)
    return lines + ["", f"Gain over {len(rows)} runs: mean **{r['gain_mean'] * 100:+.1f}** points (sd "
                        f"{r['gain_std'] * 100:.1f}), minimum **{r['gain_min'] * 100:+.1f}**; target "
                        f"+{r['target_gain'] * 100:.0f} in every run: **{'met' if r['meets_target'] else 'not met'}**."]


def multi_seed(r: dict[str, Any]) -> bool:
    return "verdict" in r and any(isinstance(v, dict) and "final_accuracy_mean" in v for v in r.values())


def learning(r: dict[str, Any]) -> list[str]:
    if not multi_seed(r):
        return ["(single-seed file from before the multi-seed benchmark)"]
    verdict, rows = r["verdict"], []
    for name, x in r.items():
        if isinstance(x, dict) and "final_accuracy_mean" in x:
            v = verdict.get(name, {})
            rows.append([name, f"{pct(x['final_accuracy_mean'])} ± {pct(x['final_accuracy_std'])}",
                         num(v.get("accuracy_vs_sync", 1.0)),
                         num(v["worst_seed_vs_sync"]) if "worst_seed_vs_sync" in v else "-",
                         pct(x["last3_accuracy_mean"]) if "last3_accuracy_mean" in x else "-",
                         f"{num(x['wall_s_mean'], 0)} ± {num(x['wall_s_std'], 0)}",
                         f"{num(v.get('speedup_vs_sync', 1.0))}x", num(x["mean_staleness_mean"]),
                         ", ".join(f"{k} {v}" for k, v in sorted(x.get("dropped", {}).items())) or "0"])
    base = r["base_accuracy"]
    return table(["setting", "held-out accuracy (mean ± sd)", "vs sync", "worst seed vs sync", "last 3 evals",
                  "wall s (mean ± sd)", "speed-up", "staleness", "groups dropped (all seeds)"], rows) + [
        "", f"Base accuracy per seed: {', '.join(pct(b) for b in base.values())}. 'worst seed vs sync': the lowest "
            "seed's final accuracy over sync's mean; 'last 3 evals': the mean of each run's last three held-out "
            "evaluations, averaged over seeds.", *learning_goals(r)]


def learning_goals(r: dict[str, Any]) -> list[str]:
    """Issue 25's goals, read off the verdicts of the rows that have them."""
    verdict = r["verdict"]
    s4, s8 = verdict.get("async_s4"), verdict.get("async_s8")
    if s4 is None or s8 is None or "worst_seed_vs_sync" not in s4:
        return []
    async_rows = [k for k in verdict if not k.endswith("_no_admission") and not k.endswith("_no_is")]
    slower = [k for k in async_rows if verdict[k]["speedup_vs_sync"] <= 1.0]
    most_stale = max(verdict[k]["stale_drop_frac"] for k in async_rows)
    return ["", f"Goals (admission rows): staleness 4 at {num(s4['accuracy_vs_sync'])} of sync's mean (goal >= "
            f"0.95), worst seed {num(s4['worst_seed_vs_sync'])} (goal >= 0.90); staleness 8 at "
            f"{num(s8['accuracy_vs_sync'])} (goal >= 0.90); async rows slower than sync: "
            f"{', '.join(slower) or 'none'}; stale drops at most {pct(most_stale)} of groups (goal <= 1%)."]


def tool_use(r: dict[str, Any]) -> list[str]:
    rows = [[str(x["seed"]), pct(x["accuracy_before"]), f"**{pct(x['accuracy_after'])}**", pct(x["tool_rate_before"]),
             pct(x["tool_rate_after"]), num(x["rl_wall_s"], 0)] for x in r["runs"]]
    s = r["summary"]
    return table(["seed", "accuracy before", "after", "tool-call rate before", "after", "RL s"], rows) + [
        "", f"Mean over {len(rows)} seeds: accuracy {pct(s['accuracy_before']['mean'])} -> "
            f"**{pct(s['accuracy_after']['mean'])}** (min {pct(s['accuracy_after']['min'])}), tool-call rate "
            f"{pct(s['tool_rate_before']['mean'])} -> {pct(s['tool_rate_after']['mean'])}."]


def openai_agent(r: dict[str, Any]) -> list[str]:
    """The agent example's seeds, then the endpoint against vLLM's own server, then sticky routing; each part
    with the run that measured it."""
    lines: list[str] = []

    def measured(part: dict[str, Any]) -> list[str]:
        run = part.get("run")
        return [] if run is None else ["", f"Measured by `{run['command']}` on {run['date'][:10]}, load "
                                           f"{run['loadavg_at_start'][0]:.1f} at its start."]
    if "learning" in r:
        x = r["learning"]
        rows = [[str(y["seed"]), pct(y["accuracy_before"]), f"**{pct(y['accuracy_after'])}**",
                 pct(y["tool_rate_before"]), pct(y["tool_rate_after"]), num(y["calls_per_episode"], 2),
                 str(y["splits"]), num(y["rl_wall_s"], 0)] for y in x["runs"]]
        g = x["summary"]["gain_points"]
        lines += table(["seed", "accuracy before", "after", "tool-call rate before", "after", "calls/episode",
                        "splits", "RL s"], rows)
        lines += ["", f"Mean gain **{g['mean']:+.1f} points** (sd {g['sd']:.1f}, min {g['min']:+.1f}).", *measured(x)]
    if "latency" in r:
        x = r["latency"]
        rows = [[side, num(x[side]["p50_ms"], 0), num(x[side]["p99_ms"], 0), str(x[side]["requests"]),
                 num(x[side]["completion_tokens_mean"], 1)] for side in ("vllm", "engine", "asyncrl") if side in x]
        lines += ["", f"Chat completions at concurrency {x['concurrency']}, {x['max_tokens']} tokens each:", "",
                  *table(["served by", "p50 ms", "p99 ms", "requests", "tokens/request"], rows), "",
                  f"asyncrl's endpoint over vLLM's server: p50 x{num(x['ratio_p50'])}, p99 x{num(x['ratio_p99'])} "
                  f"(`engine`: asyncrl's server client alone, without the endpoint).", *measured(x)]
    if "routing" in r:
        x = r["routing"]
        rows = [["vLLM's default" if v["kv_blocks"] is None else f"{v['kv_blocks']} blocks of 32 tokens",
                 {"sticky": "sticky", "roaming": "least-loaded"}[side],
                 pct(v[side]["prefix_cache_hit_rate"]), num(v[side]["p50_ms"], 0), num(v[side]["p99_ms"], 0),
                 str(v[side]["calls"])] for regime, v in x.items() if regime != "run" for side in ("sticky", "roaming")]
        head = x["roomy"]
        lines += ["", f"{head['sessions']} sessions of {head['turns']} calls per round over two servers, each server's "
                      "KV cache at vLLM's default size, then capped:", "",
                  *table(["KV cache per server", "routing", "prefix-cache hit rate", "p50 ms", "p99 ms", "calls"],
                         rows), *measured(x)]
    return lines


TRAINER_NAMES = {"grpo": "GRPO", "dpo": "Online DPO", "xpo": "XPO", "nash_md": "Nash-MD"}


def preference(r: dict[str, Any]) -> list[str]:
    """Every run as it came out, then per trainer and mode the mean gain with its spread."""
    rows = [[TRAINER_NAMES[x["trainer"]], x["mode"], str(x["seed"]), pct(x["before"]), pct(x["after"]),
             f"{x['gain'] * 100:+.1f}", num(x["samples_per_s"], 0), str(x["dropped"].get("preference_tie", 0)),
             num(x["rl_wall_s"], 0)] for x in r["runs"].values()]
    lines = table(["trainer", "mode", "seed", "held-out before", "after", "gain (points)", "samples/s",
                   "tied groups dropped", "RL s"], rows)
    summary = [[TRAINER_NAMES[key.rsplit("_", 1)[0]], key.rsplit("_", 1)[1], str(len(v["gains"])),
                f"**{v['gain_mean'] * 100:+.1f}**", f"{v['gain_std'] * 100:.1f}", f"{v['gain_min'] * 100:+.1f}",
                num(v["samples_per_s_mean"], 0)] for key, v in r["by_trainer"].items()]
    lines += ["", *table(["trainer", "mode", "seeds", "mean gain", "sd", "min", "samples/s"], summary)]
    dpo = [x["gain"] for x in r["runs"].values() if x["trainer"] == "dpo"]
    if dpo:
        lines += ["", f"Online DPO's goal, +{r['target_gain'] * 100:.0f} points in every seed: "
                      f"**{'met' if r['dpo_meets_target'] else 'not met'}** (minimum {min(dpo) * 100:+.1f})."]
    return lines


FORMATTERS: dict[str, tuple[str, str, Callable[[dict[str, Any]], list[str]]]] = {
    "openai_agent": ("Agents through the OpenAI-compatible endpoint", "bench/cpu/openai_agent.py: the openai_agent "
                     "example over seeds (held-out accuracy before and after GRPO); the endpoint against vLLM's own "
                     "OpenAI server; sticky against roaming sessions over two servers.", openai_agent),
    "preference": ("Preference trainers against GRPO", "bench/cpu/preference.py: Online DPO, XPO and Nash-MD "
                   "(judge from the exact answer) and GRPO on the demo's task, same warm-started model per seed, "
                   "equal trained samples, synchronous and async (staleness 2).", preference),
    "demo_seeds": ("The demo over seeds and machine numerics", "make demo's recipe, 5 seeds and 4 perturbations "
                   "of seed 0 (2 torch threads, bf16 warm start, warm start stopped at 25% / 35%).", demo_seeds),
    "demo_lora": ("The demo with LoRA over seeds", "make demo ARGS=--lora: a LoRA adapter (rank 16) trained on "
                  "the frozen warm-started policy and published alone, seeds 0-2.", demo_seeds),
    "learning": ("Learning: sync vs async at equal samples", "GRPO on addition; held-out greedy accuracy and "
                 "training wall time per setting, mean over seeds.", learning),
    "tool_use": ("Multi-turn tool use", "asyncrl/examples/tool_use.py over seeds: held-out accuracy and tool-call rate "
                 "before and after RL.", tool_use),
}
