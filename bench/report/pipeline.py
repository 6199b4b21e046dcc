"""Sections on the pipeline's own costs on one machine: against the bare engine, the queue layer, async vs
sync, contention between generation and training, and the pause per weight sync."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.report.format import ms, num, table


def engine_limit(r: dict[str, Any]) -> list[str]:
    rows = [["pipeline / raw engine tokens/s", f"**{num(r['ratio'], 3)}**", f">= {r['target']}"],
            ["pairs", ", ".join(num(x, 3) for x in r["pair_ratios"]), ""],
            ["raw engine tokens/s", num(r["raw_tokens_per_s"], 0), ""],
            ["pipeline tokens/s", num(r["pipe_tokens_per_s"], 0), ""]]
    for key, label in (("main_cpu_us_per_token_raw", "main process CPU per token, bare engine (vLLM defaults)"),
                       ("main_cpu_us_per_token", "main process CPU per token, whole producer path")):
        if key in r:
            rows.append([label, f"{num(r[key], 1)} µs", ""])
    if "log_ratio" in r:
        rows += [["with the rollout log / plain pipeline tokens/s", f"**{num(r['log_ratio'], 3)}**", ">= 0.97"],
                 ["pairs", ", ".join(num(x, 3) for x in r["log_pair_ratios"]), ""]]
    return table(["figure", "value", "target"], rows)


def queue_micro(r: dict[str, Any]) -> list[str]:
    rows = [["rollouts/s (best of reps)", f"**{num(r['rollouts_per_s'], 0)}**", f">= {r['target_rollouts_per_s']:,}"],
            ["rollouts/s (median)", num(r.get("rollouts_per_s_median"), 0), ""],
            ["CPU µs per rollout", num(r.get("us_per_rollout_cpu"), 1), ""],
            ["enqueue-to-dequeue p50", f"{num(r['p50_ms'], 3)} ms", ""],
            ["enqueue-to-dequeue p99", f"**{num(r['p99_ms'], 3)} ms**", "<= 1 ms"]]
    return table(["figure", "value", "target"], rows)


def async_vs_sync(r: dict[str, Any]) -> list[str]:
    rows = [["speed-up, async over sync (steady state)", f"**{num(r['speedup'])}x**"],
            ["pairs", ", ".join(f"{num(x)}x" for x in r.get("pair_speedups", []))],
            ["ideal (generation fully hidden)", f"{num(r['ideal'])}x"],
            ["ratio to ideal", num(r["ratio_to_ideal"])],
            ["whole-run speed-up", f"{num(r.get('speedup_whole_run'))}x"]]
    return table(["figure", "value"], rows)


def contention(r: dict[str, Any]) -> list[str]:
    rows = [["beside a training thread (same process)", num(r["gen_ratio_learner_thread"])],
            ["beside the same thread at nice 19", num(r["gen_ratio_learner_thread_nice19"])],
            ["beside a memory-copy process on the other core", num(r["gen_ratio_memory_stream"])],
            ["learner step slow-down beside generation", f"{num(r['learner_slowdown'])}x"]]
    return table(["generation speed, relative to generation alone", "value"], rows)


def weight_sync(r: dict[str, Any]) -> list[str]:
    rows = [[m["name"], m["transfer"], num(m["mib"], 0), ms(m.get("prepare_s")), ms(m.get("total_paused_s")),
             ms(m.get("reload_floor_s")), num(m.get("ratio_to_reload_floor"))] for m in r["models"]]
    return table(["model", "transfer", "MiB", "prepare (running)", "paused", "reload floor", "paused / floor"], rows)


def weight_sync_ab(r: dict[str, Any]) -> list[str]:
    rows = [[name, ms(s["before"]["paused_median_s"]), ms(s["after"]["paused_median_s"]),
             f"{num(s['after_over_before_paused'])}x", num(s["before"]["ratio_to_reload_floor"]),
             num(s["after"]["ratio_to_reload_floor"]), str(len(s["after"]["paused"]))]
            for name, s in r["summary"].items()]
    loads = ", ".join(f"{side} {num(doc['hardware']['loadavg_at_start'][0], 1)}" for side in ("before", "after")
                      for doc in r["runs"][side])
    return table(["model", "paused before", "after", "after / before", "paused / floor before", "after",
                  "reps per side"], rows) + ["", f"Before: commit `{r['before_commit'][:8]}`. The runs' load at start, "
                                                 f"in order: {loads}."]


def bench_ab(r: dict[str, Any]) -> list[str]:
    rows = [[name, num(s["before"], 4), num(s["after"], 4), num(s["after_over_before"], 3)]
            for name, s in r["summary"].items()]
    loads = ", ".join(f"{side} {num(doc['hardware']['loadavg_at_start'][0], 1)}" for side in ("before", "after")
                      for doc in r["runs"][side])
    return table(["figure", "before (median)", "after (median)", "after / before"], rows) + [
        "", f"Before: commit `{r['before'][:8]}`, {len(r['runs']['before'])} runs a side, alternated. The runs' load "
            f"at start: {loads}."]


AB = ("{} before and after a change", "bench.cpu.{} on two revisions, alternated in one run "
      "(``bench.cpu.bench_ab``); medians of each side.")

FORMATTERS: dict[str, tuple[str, str, Callable[[dict[str, Any]], list[str]]]] = {
    "ab_engine_limit": (AB[0].format("Engine limit"), AB[1].format("engine_limit"), bench_ab),
    "ab_queue_micro": (AB[0].format("Queue layer"), AB[1].format("queue_micro"), bench_ab),
    "engine_limit": ("Engine limit", "Tokens/s through the whole producer path vs the bare engine, same "
                     "requests, pairs alternated.", engine_limit),
    "queue_micro": ("Queue layer", "Producer -> queue -> consumer with an engine that costs nothing.", queue_micro),
    "async_vs_sync": ("Async vs sync, same work", "Samples/s of the overlapped pipeline vs generate-then-train.",
                      async_vs_sync),
    "contention": ("What overlap costs on this machine", "Generation speed beside other work.", contention),
    "weight_sync": ("Weight sync", "Time generation is paused per publication, against the engine's own reload "
                    "floor.", weight_sync),
    "weight_sync_ab": ("Weight sync before and after a change", "bench.cpu.weight_sync on two revisions, run in "
                       "turn; medians over every rep of each side.", weight_sync_ab),
}
