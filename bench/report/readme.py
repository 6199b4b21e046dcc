"""The figure blocks (between ``<!-- figures:NAME:begin -->`` and ``end`` markers) of README.md (the demo over
seeds) and docs/RESULTS.md (tool use, the headline figures, the staleness defaults)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from bench import common
from bench.gpu.workload_rates import TRL_LABELS, over_fastest_trl
from bench.report.document import load_cited, repeat_of, results_of
from bench.report.format import cite, ms, num, pct, spread
from bench.report.gpu import compiled_kind
from bench.report.learning import multi_seed
from bench.report import seven_b

README = common.ROOT / "README.md"
RESULTS = common.ROOT / "docs" / "RESULTS.md"
GPU = common.ROOT / "docs" / "GPU.md"


def _load(results_dir: Path, name: str) -> tuple[dict[str, Any], str] | None:
    return load_cited(results_dir / f"{name}.json")


def demo_block(results_dir: Path) -> str:
    loaded = _load(results_dir, "demo_seeds_cpu")
    if loaded is None:
        return "(no demo_seeds result yet: `python -m bench.cpu.demo_seeds`)"
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
        return "(no tool_use result yet: `python -m bench.cpu.tool_use`)"
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
    if (x := _load(results_dir, "learning_cpu")) is not None and multi_seed(x[0]):
        r, source = x
        best = max(((k, v) for k, v in r["verdict"].items() if not k.endswith(("_no_is", "_full", "_no_admission"))
                    and "_full_" not in k and v["accuracy_vs_sync"] >= 0.95),
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


def workload_shapes(r: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The (shape, its sides) entries of a GPU workload result."""
    return [(k, v) for k, v in r.items() if isinstance(v, dict) and "ours" in v]


def gpu_headlines(results_dir: Path) -> list[str]:
    lines = []
    if (x := _load(results_dir, "gpu_workload_h200")) is not None:
        r, source = x
        earlier = repeat_of(results_dir / "gpu_workload_h200.json")
        for shape, side in workload_shapes(r):
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
                    "off": "nothing compiled"}[compiled_kind(best)]
        lines.append(f"- Learner, {r['shape']} bf16: **{num(best['tokens_per_s'], 0)} tokens/s, MFU "
                     f"{pct(best['mfu'])}** with varlen attention, {compiled} and "
                     f"{num(best['micro_batch_tokens'], 0)}-token micro-batches, {num(gain)}x packed sdpa in the "
                     f"same run ({source}).")
    return lines


def staleness_block(results_dir: Path) -> str:
    """Why the staleness defaults are what they are: the learning bench's admission rows, its rows trained at the
    bound, and the GPU workload's token books at the default."""
    loaded = _load(results_dir, "learning_cpu")
    if loaded is None or "async_s4_full" not in loaded[0]["verdict"]:
        return "(no learning result with admission yet: `python -m bench.cpu.learning`)"
    r, source = loaded
    v = r["verdict"]

    def row(name: str) -> str:
        x = v[name]
        return (f"{name} {num(x['accuracy_vs_sync'])} (worst seed {num(x['worst_seed_vs_sync'])}, mean staleness "
                f"{num(r[name]['mean_staleness_mean'])}, {num(x['speedup_vs_sync'])}x faster)")

    admitted = [k for k in ("async_s1", "async_s2", "async_s4", "async_s8") if k in v]
    full = [k for k in v if "_full" in k]
    stale = max(v[k]["stale_drop_frac"] for k in admitted + full)
    text = (f"On the CPU learning bench, held-out accuracy relative to synchronous training at equal samples, means "
            f"over {len(r['base_accuracy'])} seeds ({source}): with admission and one batch of queue, "
            f"{'; '.join(row(k) for k in admitted)}. Trained at the bound (the queue sized to it, so every group is "
            f"that stale): {'; '.join(row(k) for k in full)}. Old rule (no admission) at 4: "
            f"{row('async_s4_no_admission')}. Stale drops with admission: at most {pct(stale)} of groups.")
    # 0.5B: one 24-step run of all sides. 1.5B: a 24-step run of ours' two sides; TRL from a 12-step run of all three.
    for name, trl_name in (("gpu_workload_h200_s24", None),
                           ("gpu_workload_h200_q15_s24", "gpu_workload_h200_q15_admission")):
        if (g := _load(results_dir, name)) is not None:
            text += " " + _gpu_books(*g, _load(results_dir, trl_name) if trl_name else g)
    return text


def _gpu_books(w: dict[str, Any], source: str, trl: tuple[dict[str, Any], str] | None) -> str:
    """One sentence per shape: the share of generated tokens async trains, its length against sync's, and the
    tokens/s ratios over sync and over TRL's fastest mode."""
    parts = []
    for shape, side in workload_shapes(w):
        ours, sync = side["ours"].get("async"), side["ours"].get("sync")
        if not (ours and sync and ours.get("tokens_generated")):
            continue
        vs = over_fastest_trl(trl[0], shape) if trl else None
        over_trl = (f", and {num(vs[2])}x TRL's fastest single-GPU mode ({TRL_LABELS[vs[0]]}"
                    + (f", {trl[1]}" if trl[1] != source else "") + ")") if vs else ""
        parts.append(f"On one H200 ({shape}, {ours['steps']} steps, long-tailed lengths, the defaults), "
                     f"async trains {pct(ours['completion_tokens'] / ours['tokens_generated'])} of the completion "
                     f"tokens it generates (the rest unused at shutdown), trained mean length "
                     f"{num(ours['completion_len_mean'], 1)} against {num(sync['completion_len_mean'], 1)} for sync, "
                     f"at {num(w['summary'][shape + '/async_over_sync_tokens'])}x sync's completion tokens/s"
                     f"{over_trl} ({source}).")
    return " ".join(parts)


def lora_block(results_dir: Path) -> str:
    """The LoRA demo over seeds, and LoRA against full fine-tuning on the GPU."""
    lines = []
    if (x := _load(results_dir, "demo_lora_cpu")) is not None:
        r, source = x
        lines.append(f"- The demo with `--lora` (rank 16 on the frozen warm-started policy, the adapter published "
                     f"alone, every publication probed): held-out accuracy **{pct(r['before_mean'])} -> "
                     f"{pct(r['after_mean'])}**, a gain of **{r['gain_mean'] * 100:+.1f} points** (sd "
                     f"{r['gain_std'] * 100:.1f}, minimum **{r['gain_min'] * 100:+.1f}**) over {len(r['runs'])} seeds; "
                     f"the goal of +{r['target_gain'] * 100:.0f} in every seed is "
                     f"{'met' if r['meets_target'] else '**not met**'} ({source}).")
    for path in sorted(results_dir.glob("lora_h200*.json")):
        r, source = load_cited(path)
        for shape, e in r["shapes"].items():
            v, full, lora = e.get("lora_over_full"), e.get("full"), e.get("lora")
            if not (v and full and lora):
                continue
            layers = "compiled" if full.get("learner_options", {}).get("compile_layers") else "eager"
            lines.append(f"- One H200, {shape}, ours async, learner layers {layers}, LoRA rank {lora['lora']['rank']} "
                         f"against full fine-tuning in one run: publication pause "
                         f"{ms(lora['publication_pause_s']['mean'])} against "
                         f"{ms(full['publication_pause_s']['mean'])}; learner peak memory "
                         f"{num(lora['learner_peak_allocated_gib'], 1)} GiB against "
                         f"{num(full['learner_peak_allocated_gib'], 1)}, the whole GPU's "
                         f"{num(max(lora['gpu_peak_used_gib']), 1)} GiB against "
                         f"{num(max(full['gpu_peak_used_gib']), 1)}; "
                         f"trained samples/s **{num(v['samples_per_s'])}x**, completion tokens/s "
                         f"**{num(v['tokens_per_s'])}x** full's ({source}).")
    return "\n".join(lines) or "(no LoRA results yet: `python -m bench.cpu.demo_seeds --lora`, `bench/gpu/run_lora.sh`)"


def preference_block(results_dir: Path) -> str:
    """Held-out gains of the preference trainers and GRPO at equal samples, and whether weighting stale pairs
    changed Online DPO's."""
    from bench.report.learning import TRAINER_NAMES

    x = _load(results_dir, "preference_cpu")
    if x is None:
        return "(no preference results yet: `python -m bench.cpu.preference`)"
    r, source = x
    parts = [f"{TRAINER_NAMES[key.rsplit('_', 1)[0]]} {key.rsplit('_', 1)[1]} **{v['gain_mean'] * 100:+.1f}** "
             f"(sd {v['gain_std'] * 100:.1f}, min {v['gain_min'] * 100:+.1f})" for key, v in r["by_trainer"].items()]
    seeds = sorted({row["seed"] for row in r["runs"].values()})
    text = (f"Held-out accuracy gain in points over seeds {', '.join(map(str, seeds))}, at equal trained samples on "
            f"the demo's task: {'; '.join(parts)} ({source}). Online DPO's goal of +{r['target_gain'] * 100:.0f} in "
            f"every seed is {'met' if r['dpo_meets_target'] else '**not met**'}.")
    variants = {"preference_cpu_steps600": "With three times the samples (600 steps), Online DPO async gains",
                "preference_cpu_pair_is": "Online DPO async with stale pairs importance-weighted:"}
    for name, said in variants.items():
        if (y := _load(results_dir, name)) is not None and (v := y[0]["by_trainer"].get("dpo_async")):
            text += (f" {said} **{v['gain_mean'] * 100:+.1f}** (sd {v['gain_std'] * 100:.1f}, "
                     f"min {v['gain_min'] * 100:+.1f}) ({y[1]}).")
    return text


def agent_block(results_dir: Path) -> str:
    """The openai_agent example's gain over seeds, the endpoint's cost, and what stickiness buys."""
    x = _load(results_dir, "openai_agent_cpu")
    if x is None:
        return "(no agent results yet: `python -m bench.cpu.openai_agent`)"
    r, source = x
    parts = []
    if "learning" in r:
        s = r["learning"]["summary"]
        parts.append(f"The calculator agent, written against the openai client alone, learns through the endpoint: "
                     f"held-out accuracy **{pct(s['accuracy_before']['mean'])} -> {pct(s['accuracy_after']['mean'])}"
                     f"** (gain {s['gain_points']['mean']:+.1f} points, sd {s['gain_points']['sd']:.1f}, minimum "
                     f"{s['gain_points']['min']:+.1f}), tool-call rate {pct(s['tool_rate_before']['mean'])} -> "
                     f"{pct(s['tool_rate_after']['mean'])}, over {len(r['learning']['runs'])} seeds.")
    if "latency" in r:
        v = r["latency"]
        parts.append(f"In front of a vLLM server, the endpoint answers at p50 {num(v['asyncrl']['p50_ms'], 0)} ms "
                     f"against the server's own {num(v['vllm']['p50_ms'], 0)} ms (x{num(v['ratio_p50'])}; p99 "
                     f"x{num(v['ratio_p99'])}) at concurrency {v['concurrency']}.")
    if "routing" in r:
        runs = [v for k, v in r["routing"].items() if k != "run"]

        def cache(v: dict[str, Any]) -> str:
            blocks = v["kv_blocks"]
            return "at the default KV cache" if blocks is None else f"with {blocks} KV blocks per server"
        parts.append("Over two servers, sticky sessions hit the prefix cache for " + "; ".join(
            f"{pct(v['sticky']['prefix_cache_hit_rate'])} of prompt tokens against "
            f"{pct(v['roaming']['prefix_cache_hit_rate'])} for least-loaded routing {cache(v)} "
            f"(p50 {num(v['sticky']['p50_ms'], 0)} against {num(v['roaming']['p50_ms'], 0)} ms)" for v in runs) + ".")
    return " ".join(parts) + f" ({source})"


def fp8_block(results_dir: Path) -> str:
    """FP8 rollouts against bf16 on one GPU: decode speed and the publication pause, side by side."""
    x = _load(results_dir, "fp8_h200_q15b")
    if x is None:
        return "(no FP8 result yet: `python -m bench.gpu.fp8 --shape qwen2-1.5b`)"
    r, source = x
    fp8, bf16 = r["rounds"][0]["fp8"], r["rounds"][0]["bf16"]
    return (f"At the 1.5B shape on one H200, the same bf16 checkpoint served in FP8 decodes at "
            f"**{num(r['decode_speedup_median'], 3)}x** the tokens/s of bf16 "
            f"({num(fp8['decode_tokens_per_s'], 0)} against {num(bf16['decode_tokens_per_s'], 0)}, "
            f"{len(r['rounds'])} round), and a publication of the learner's bf16 weights into it pauses "
            f"{ms(fp8['publication_pause_median_s'])} against {ms(bf16['publication_pause_median_s'])} "
            f"(x{num(r['pause_ratio_median'])}; the FP8 quantization runs while staging, before the pause) ({source})."
            + seven_b.fp8_paragraph(results_dir) + fp8_learning(results_dir))


def fp8_learning(results_dir: Path) -> str:
    """The async pipeline with FP8 rollouts against bf16 rollouts, same warm start and prompts, one file a seed
    (``gpu_workload_*_q15_fp8_s24*.json``: seed 0 untagged, then ``_seed<N>``)."""
    runs = []
    for path in sorted(results_dir.glob("gpu_workload_*_q15_fp8_s24*.json")):
        doc = json.loads(path.read_text())
        r = results_of(doc)
        ours = r["qwen2-1.5b"]["ours"]
        if "async" in ours and "async_fp8" in ours:
            runs.append((doc["parameters"]["seed"], ours, r["summary"], cite(path, doc)))
    if not runs:
        return ""
    runs.sort(key=lambda run: run[0])
    rows = []
    for seed, ours, ratios, _ in runs:
        bf16, fp8 = ours["async"], ours["async_fp8"]
        rows.append(f"seed {seed}: mean reward {spread(fp8['rewards'])} with FP8 rollouts against "
                    f"{spread(bf16['rewards'])} with bf16, trained completion tokens/s over the steady steps "
                    f"**x{num(ratios['qwen2-1.5b/async_fp8_over_async_steady'], 3)}** "
                    f"({num(fp8['completion_tokens_per_s_steady'], 0)} against "
                    f"{num(bf16['completion_tokens_per_s_steady'], 0)}), x"
                    f"{num(ratios['qwen2-1.5b/async_fp8_over_async_tokens'], 3)} over the whole run, whose first "
                    f"step ended at {num(fp8['step_end_s'][0], 1)} s against {num(bf16['step_end_s'][0], 1)} s")
    gaps = [statistics.mean(o["async_fp8"]["rewards"]) - statistics.mean(o["async"]["rewards"]) for _, o, _, _ in runs]
    speed = [r["qwen2-1.5b/async_fp8_over_async_steady"] for _, _, r, _ in runs]
    kl = [v for _, o, _, _ in runs for v in o["async_fp8"]["mismatch_kl"] if v == v]
    cut = [v for _, o, _, _ in runs for v in o["async_fp8"]["mismatch_cut_frac"] if v == v]
    over = (f"Over the {len(runs)} seeds, FP8's mean reward minus bf16's is {spread(gaps, signed=True)} and the "
            f"steady speed-up **x{spread(speed)}** (mean ± sd). " if len(runs) > 1 else "")
    cuts = (f"at most {pct(max(cut))} of importance weights cut" if cut and max(cut) > 0
            else "no importance weight cut")
    pauses = "; ".join(f"seed {seed}: {_pause(o['async_fp8'])} into FP8 against {_pause(o['async'])} into bf16"
                       for seed, o, _, _ in runs)
    return (f"\n\nLearning with FP8 rollouts (the countdown task at 1.5B, {len(runs[0][1]['async_fp8']['rewards'])} "
            f"async steps a side, the same warm start and prompts within a seed, mean ± step-to-step spread): "
            + "; ".join(rows) + ". The bf16 side runs first, and its learner's first step compiles code the "
            "FP8 side then finds ready, so the steady steps (the first two left out) are the fair comparison. " + over
            + f"The mismatch at equal versions stayed small: k3 KL at most {max(kl):.0e} a step, {cuts} "
            f"(`truncate`). Publication pause, mean (largest): {pauses} "
            f"({'; '.join(source for *_, source in runs)}). " + _pairing(max(kl), max(cut, default=0.0)))


def _pairing(kl: float, cut: float) -> str:
    """Which correction to pair with FP8, read from the largest mismatch the runs measured (the guidance for
    choosing between them is in ARCHITECTURE.md, "Versions, spans and staleness")."""
    if cut <= 0.01:
        return (f"So `truncate`, the default, is the correction to pair with FP8 at this shape: its cap cut "
                f"{pct(cut)} of the equal-version tokens, so the mismatch sits where truncation is enough; token "
                f"masking (`mask`) is for a mismatch that leaves a few tokens far off, which these runs did not show.")
    return (f"With {pct(cut)} of the equal-version tokens over truncation's cap (k3 KL up to {kl:.0e}), pair FP8 "
            f"with token masking (`mask`): the far-off tokens are a numerical mismatch, which masking drops rather "
            f"than trains on at a capped weight.")


def _pause(side: dict[str, Any]) -> str:
    return f"{ms(side['publication_pause_s']['mean'])} ({ms(side['publication_pause_s']['max'])})"


def structure_block(results_dir: Path) -> str:
    """The group-maker restructuring against the revision before it, alternated in one run."""
    lines = []
    for bench, figures in (("queue_micro", ("rollouts_per_s", "p99_ms")), ("engine_limit", ("ratio",))):
        x = _load(results_dir, f"ab_{bench}_cpu")
        if x is None:
            lines.append(f"- {bench}: (no result yet: `python -m bench.cpu.bench_ab --bench {bench} --before 1d611fb`)")
            continue
        r, source = x
        def fig(v: float) -> str:
            return num(v, 0) if v >= 100 else num(v, 3)
        told = ", ".join(f"{name} {fig(r['summary'][name]['before'])} -> {fig(r['summary'][name]['after'])} "
                         f"(**x{num(r['summary'][name]['after_over_before'], 3)}**)" for name in figures)
        lines.append(f"- {bench}, `{r['before'][:8]}` -> this tree, medians of {len(r['runs']['after'])} runs a "
                     f"side: {told} ({source}).")
        if (earlier := repeat_of(results_dir / f"ab_{bench}_cpu.json")) is not None:
            e = results_of(earlier[0])["summary"]
            lines[-1] += (" An earlier run of the same command: " + ", ".join(
                f"{name} x{num(e[name]['after_over_before'], 3)}" for name in figures) + ".")
    return "\n".join(lines)


# Which document holds which blocks.
FIGURED = {README: ("demo",), RESULTS: ("tool_use", "headline", "staleness", "preference", "lora", "agents", "fp8",
                                        "structure", "seven_b"), GPU: ("seven_b_memory",)}


def render_figures(doc: Path, text: str, results_dir: Path = common.RESULTS) -> str:
    """``text`` (the contents of ``doc``) with its figure blocks regenerated from the result files."""
    blocks = {"demo": demo_block, "tool_use": tool_use_block, "headline": headline_block,
              "staleness": staleness_block, "lora": lora_block, "preference": preference_block,
              "agents": agent_block, "fp8": fp8_block, "structure": structure_block,
              "seven_b": seven_b.seven_b_block, "seven_b_memory": seven_b.memory_block}
    for name in FIGURED[doc]:
        begin, end = f"<!-- figures:{name}:begin -->", f"<!-- figures:{name}:end -->"
        head, _, rest = text.partition(begin)
        _, _, tail = rest.partition(end)
        if not rest:
            raise ValueError(f"{doc.name} has no {begin} marker")
        text = f"{head}{begin}\n{blocks[name](results_dir)}\n{end}{tail}"
    return text
