"""``docs/BENCHMARKS.md`` and the README's figure blocks, generated from the result files: figures are never
typed by hand.

    python -m bench.report            # write docs/BENCHMARKS.md
    python -m bench.report --check    # exit 1 if either differs from what the files give

Every ``bench/results/*.json`` gets a section: what it measures, the command that wrote it, the machine (CPU
model, cores, GPU), the load average, the versions and the date, then its headline figures. ``make test``
checks the document against the files (``tests/bench/test_benchmarks_doc.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import common, report_scale
from bench.report_util import ms, num, pct, table
from bench.workload_rates import TRL_LABELS, over_fastest_trl

DOC = common.ROOT / "docs" / "BENCHMARKS.md"
README = common.ROOT / "README.md"


def results_of(doc: dict[str, Any]) -> dict[str, Any]:
    """Result files written before the common header kept their figures at the top level."""
    return doc.get("results") or doc


# -- one formatter per benchmark -----------------------------------------------------------------------------


def demo_seeds(r: dict[str, Any]) -> list[str]:
    rows = [[name, pct(x["before"]), pct(x["after"]), f"{x['gain'] * 100:+.1f}", num(x["samples_per_s"], 0),
             num(x["total_s"], 0)] for name, x in r["runs"].items()]
    lines = table(["run", "held-out before", "after", "gain (points)", "samples/s", "run s"], rows)
    return lines + ["", f"Gain over {len(rows)} runs: mean **{r['gain_mean'] * 100:+.1f}** points (sd "
                        f"{r['gain_std'] * 100:.1f}), minimum **{r['gain_min'] * 100:+.1f}**; target "
                        f"+{r['target_gain'] * 100:.0f} in every run: **{'met' if r['meets_target'] else 'not met'}**."]


def _multi_seed(r: dict[str, Any]) -> bool:
    return "verdict" in r and any(isinstance(v, dict) and "final_accuracy_mean" in v for v in r.values())


def learning(r: dict[str, Any]) -> list[str]:
    if not _multi_seed(r):
        return ["(single-seed file from before the multi-seed benchmark)"]
    verdict, rows = r["verdict"], []
    for name, x in r.items():
        if isinstance(x, dict) and "final_accuracy_mean" in x:
            v = verdict.get(name, {})
            rows.append([name, f"{pct(x['final_accuracy_mean'])} ± {pct(x['final_accuracy_std'])}",
                         num(v.get("accuracy_vs_sync", 1.0)),
                         f"{num(x['wall_s_mean'], 0)} ± {num(x['wall_s_std'], 0)}",
                         f"{num(v.get('speedup_vs_sync', 1.0))}x", num(x["mean_staleness_mean"]),
                         ", ".join(f"{k} {v}" for k, v in sorted(x.get("dropped", {}).items())) or "0"])
    base = r["base_accuracy"]
    return table(["setting", "held-out accuracy (mean ± sd)", "vs sync", "wall s (mean ± sd)", "speed-up",
                  "staleness", "groups dropped (all seeds)"], rows) + [
        "", f"Base accuracy per seed: {', '.join(pct(b) for b in base.values())}."]


def engine_limit(r: dict[str, Any]) -> list[str]:
    rows = [["pipeline / raw engine tokens/s", f"**{num(r['ratio'], 3)}**", f">= {r['target']}"],
            ["pairs", ", ".join(num(x, 3) for x in r["pair_ratios"]), ""],
            ["raw engine tokens/s", num(r["raw_tokens_per_s"], 0), ""],
            ["pipeline tokens/s", num(r["pipe_tokens_per_s"], 0), ""]]
    for key, label in (("main_cpu_us_per_token_raw", "main process CPU per token, bare engine (vLLM defaults)"),
                       ("main_cpu_us_per_token", "main process CPU per token, whole producer path")):
        if key in r:
            rows.append([label, f"{num(r[key], 1)} µs", ""])
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


def vs_trl(r: dict[str, Any]) -> list[str]:
    rows = []
    for profile in ("demo", "genheavy"):
        if f"samples_per_s_ratio_{profile}" in r:
            rows.append([profile, f"**{num(r[f'samples_per_s_ratio_{profile}'])}x**",
                         f"{num(r.get(f'overlap_bound_{profile}'))}x", f"{r.get(f'target_{profile}')}x"])
    lines = table(["profile", "ours / TRL (samples/s)", "overlap bound", "target"], rows)
    if "accuracy_ours" in r:
        lines += ["", f"Held-out accuracy from {pct(r['accuracy_base'])}: ours {pct(r['accuracy_ours'])}, "
                      f"TRL {pct(r['accuracy_trl'])}."]
    return lines


FORMATTERS: dict[str, tuple[str, str, Callable[[dict[str, Any]], list[str]]]] = {
    "demo_seeds": ("The demo over seeds and machine numerics", "make demo's recipe, 5 seeds and 4 perturbations "
                   "of seed 0 (2 torch threads, bf16 warm start, warm start stopped at 25% / 35%).", demo_seeds),
    "learning": ("Learning: sync vs async at equal samples", "GRPO on addition; held-out greedy accuracy and "
                 "training wall time per setting, mean over seeds.", learning),
    "engine_limit": ("Engine limit", "Tokens/s through the whole producer path vs the bare engine, same "
                     "requests, pairs alternated.", engine_limit),
    "queue_micro": ("Queue layer", "Producer -> queue -> consumer with an engine that costs nothing.", queue_micro),
    "async_vs_sync": ("Async vs sync, same work", "Samples/s of the overlapped pipeline vs generate-then-train.",
                      async_vs_sync),
    "contention": ("What overlap costs on this machine", "Generation speed beside other work.", contention),
    "weight_sync": ("Weight sync", "Time generation is paused per publication, against the engine's own reload "
                    "floor.", weight_sync),
    "vs_trl": ("Against TRL", "Trained samples/s side by side in one run.", vs_trl),
    **report_scale.FORMATTERS,
}


def section(path: Path) -> list[str]:
    doc = json.loads(path.read_text())
    name = next((k for k in sorted(FORMATTERS, key=len, reverse=True) if path.name.startswith(k)), None)
    if name is None or "hardware" not in doc:
        return []
    title, what, fmt = FORMATTERS[name]
    hw, v = doc["hardware"], doc.get("versions", {})
    load = hw.get("loadavg_at_start", [None])[0], hw.get("loadavg_at_end", [None])[0]
    machine = f"{hw.get('cpu')}, {hw.get('cores')} cores" + (f", {hw['gpu']}" if hw.get("gpu") else "")
    meta = (f"`{doc.get('command', '?')}` · {machine} · load {num(load[0], 1)} -> {num(load[1], 1)} · "
            f"{str(doc.get('date', '?'))[:10]} · vLLM {v.get('vllm')}, torch {v.get('torch')}"
            + (f" · commit {doc['commit'][:8]}" if doc.get("commit") else ""))
    return [f"## {title}: `{path.relative_to(common.ROOT)}`", "", what, "", meta, "", *fmt(results_of(doc)),
            *repeat_line(name, path), ""]


# Benchmarks run more than once keep an earlier run's file under results/repeats/: its headline is shown too.
REPEATS: dict[str, Callable[[dict[str, Any]], str]] = {
    "engine_limit": lambda r: (f"ratio **{num(r['ratio'], 3)}** "
                               f"(pairs {', '.join(num(x, 3) for x in r['pair_ratios'])})"),
    "queue_micro": lambda r: f"**{num(r['rollouts_per_s'], 0)} rollouts/s**, p99 **{num(r['p99_ms'], 3)} ms**",
    "gpu_workload": lambda r: _workload_ratios(r),
}


def _workload_ratios(r: dict[str, Any]) -> str:
    """Ours async over TRL's fastest side, per shape: the rule the README's headline quotes too."""
    parts = [f"ours async over {TRL_LABELS[x[0]]}, samples/s **{num(x[1])}x**, tokens/s **{num(x[2])}x** ({shape})"
             for shape in r if (x := over_fastest_trl(r, shape))]
    return "; ".join(parts)


def repeat_of(path: Path) -> tuple[dict[str, Any], Path] | None:
    """The earlier run of ``path``'s benchmark kept under results/repeats/ (its whole document), if any."""
    other = path.parent / "repeats" / path.name
    return (json.loads(other.read_text()), other) if other.is_file() else None


def repeat_line(name: str, path: Path) -> list[str]:
    if name not in REPEATS or (earlier := repeat_of(path)) is None:
        return []
    doc, other = earlier
    load = doc["hardware"].get("loadavg_at_start", [None])[0], doc["hardware"].get("loadavg_at_end", [None])[0]
    return ["", f"An earlier run of the same command (`{other.relative_to(common.ROOT)}`, {str(doc['date'])[:16]}, "
                f"load {num(load[0], 1)} -> {num(load[1], 1)}): {REPEATS[name](results_of(doc))}."]


def render(results_dir: Path = common.RESULTS) -> str:
    lines = ["# Benchmarks", "",
             "Generated by `python -m bench.report` from the result files in `bench/results/`; do not edit by hand "
             "(`tests/bench/test_benchmarks_doc.py` fails when this file and the files disagree). Each section names "
             "its file, the command that wrote it, the machine, the load average at start and end, the date and the "
             "versions. Speed figures are ratios measured side by side in one run.", ""]
    for path in sorted(results_dir.glob("*.json")):
        lines += section(path)
    return "\n".join(lines).rstrip() + "\n"


# -- the README's figure blocks ---------------------------------------------------------------------------------


def _load(results_dir: Path, name: str) -> tuple[dict[str, Any], str] | None:
    path = results_dir / f"{name}.json"
    if not path.is_file():
        return None
    doc = json.loads(path.read_text())
    return results_of(doc), f"`{path.relative_to(common.ROOT)}`, {doc['hardware']['cpu']}, {str(doc['date'])[:10]}"


def demo_block(results_dir: Path) -> str:
    loaded = _load(results_dir, "demo_seeds_cpu")
    if loaded is None:
        return "(no demo_seeds result yet: `python -m bench.demo_seeds`)"
    r, source = loaded
    n = len(r["runs"])
    short = ", ".join(f"{k} {x['gain'] * 100:+.1f}" for k, x in r["runs"].items() if x["gain"] < r["target_gain"])
    return (f"Held-out greedy accuracy over {n} runs (5 seeds, then seed 0 with 2 torch threads, a bf16 warm start, "
            f"and warm starts stopped at 25% and 35%): **{pct(r['before_mean'])} -> {pct(r['after_mean'])}** on "
            f"average, a gain of **{r['gain_mean'] * 100:+.1f} points** (sd {r['gain_std'] * 100:.1f}, minimum "
            f"**{r['gain_min'] * 100:+.1f}**), at {num(r['samples_per_s_mean'], 0)} trained samples/s on 2 cores "
            f"({source}). The goal of +{r['target_gain'] * 100:.0f} points in every run is "
            f"{'met' if r['meets_target'] else f'**not met** ({short}; per-run table in docs/BENCHMARKS.md)'}.")


def tool_use_block(results_dir: Path) -> str:
    loaded = _load(results_dir, "tool_use_cpu")
    if loaded is None:
        return "(no tool_use result yet: `python -m bench.tool_use`)"
    r, source = loaded
    s = r["summary"]
    return (f"Warm-started briefly, the calculator example learns to call its tool: held-out accuracy "
            f"**{pct(s['accuracy_before']['mean'])} -> {pct(s['accuracy_after']['mean'])}** (minimum after "
            f"{pct(s['accuracy_after']['min'])}), tool-call rate {pct(s['tool_rate_before']['mean'])} -> "
            f"{pct(s['tool_rate_after']['mean'])}, means over {len(r['runs'])} seeds ({source}).")


def headline_block(results_dir: Path) -> str:
    lines = []
    if (x := _load(results_dir, "engine_limit_cpu")) is not None:
        r, source = x
        lines.append(f"- Engine limit: the whole producer path runs at **{num(r['ratio'], 3)}** of the bare engine's "
                     f"tokens/s ({source}).")
    if (x := _load(results_dir, "queue_micro_cpu")) is not None:
        r, source = x
        lines.append(f"- Queue layer: **{num(r['rollouts_per_s'], 0)} rollouts/s**, p99 enqueue-to-dequeue "
                     f"**{num(r['p99_ms'], 2)} ms** ({source}).")
    if (x := _load(results_dir, "learning_cpu")) is not None and _multi_seed(x[0]):
        r, source = x
        best = max(((k, v) for k, v in r["verdict"].items() if not k.endswith("_no_is")),
                   key=lambda kv: kv[1]["speedup_vs_sync"], default=None)
        if best is not None:
            lines.append(f"- Learning at equal samples: {best[0]} reaches {num(best[1]['accuracy_vs_sync'])}x the "
                         f"synchronous accuracy in 1/{num(best[1]['speedup_vs_sync'])} of its wall time, means "
                         f"over seeds ({source}).")
    if (x := _load(results_dir, "weight_sync_cpu")) is not None:
        r, source = x
        m = r["models"][0]
        lines.append(f"- Weight sync: generation paused {ms(m['total_paused_s'])} for a {num(m['mib'], 0)} MiB "
                     f"model, {num(m['ratio_to_reload_floor'])}x vLLM's own reload ({source}).")
    return "\n".join(lines + gpu_headlines(results_dir)) or "(no results yet)"


def _earlier_workload(earlier: tuple[dict[str, Any], Path] | None, shape: str) -> str:
    """The same ratios from the earlier run, where there is one: TRL's rate varies from run to run, so one run
    is not quoted alone."""
    if earlier is None or (vs := over_fastest_trl(results_of(earlier[0]), shape)) is None:
        return ""
    return (f"; an earlier run of the same command gave {num(vs[1])}x and {num(vs[2])}x over its fastest TRL mode "
            f"(`{earlier[1].relative_to(common.ROOT)}`)")


def gpu_headlines(results_dir: Path) -> list[str]:
    lines = []
    if (x := _load(results_dir, "gpu_workload_h200")) is not None:
        r, source = x
        earlier = repeat_of(results_dir / "gpu_workload_h200.json")
        for shape, side in ((k, v) for k, v in r.items() if isinstance(v, dict) and "ours" in v):
            ours, vs = side["ours"].get("async"), over_fastest_trl(r, shape)
            if ours and vs:
                lines.append(f"- GPU, {shape}, long-tailed completions: ours async trains "
                             f"{num(ours['samples_per_s'], 1)} samples/s against TRL's fastest single-GPU mode in "
                             f"the run ({TRL_LABELS[vs[0]]}) at {num(side[vs[0]]['samples_per_s'], 1)}: "
                             f"**{num(vs[1])}x** in samples/s, **{num(vs[2])}x** in completion tokens/s "
                             f"({source}){_earlier_workload(earlier, shape)}.")
    if (x := _load(results_dir, "learner_speed_h200_ladder")) is not None:
        r, source = x
        best = max(r["runs"], key=lambda run: run["tokens_per_s"])
        first = r["runs"][0]
        gain = best["tokens_per_s"] / first["tokens_per_s"]
        compiled = {"layers": "compiled decoder layers", "chains": "compiled element-wise chains",
                    "off": "nothing compiled"}[report_scale.compiled_kind(best)]
        lines.append(f"- Learner, {r['shape']} bf16: **{num(best['tokens_per_s'], 0)} tokens/s, MFU "
                     f"{pct(best['mfu'])}** with varlen attention, {compiled} and "
                     f"{num(best['micro_batch_tokens'], 0)}-token micro-batches, {num(gain)}x packed sdpa in the "
                     f"same run ({source}).")
    return lines


def render_readme(text: str, results_dir: Path = common.RESULTS) -> str:
    for name, block in (("demo", demo_block(results_dir)), ("tool_use", tool_use_block(results_dir)),
                        ("headline", headline_block(results_dir))):
        begin, end = f"<!-- figures:{name}:begin -->", f"<!-- figures:{name}:end -->"
        head, _, rest = text.partition(begin)
        _, _, tail = rest.partition(end)
        if not rest:
            raise ValueError(f"README.md has no {begin} marker")
        text = f"{head}{begin}\n{block}\n{end}{tail}"
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="compare instead of writing")
    args = p.parse_args(argv)
    text, readme = render(), render_readme(README.read_text())
    if args.check:
        same = DOC.is_file() and DOC.read_text() == text and README.read_text() == readme
        print("docs/BENCHMARKS.md and README.md match the result files" if same else
              "docs/BENCHMARKS.md or README.md is out of date: run python -m bench.report")
        return 0 if same else 1
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(text)
    README.write_text(readme)
    print(f"wrote {DOC.relative_to(common.ROOT)} and the figure blocks of README.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
