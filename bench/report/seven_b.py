"""The 7B figures: the planted Qwen2.5-7B workload on one GPU (``bench/gpu/run_7b.sh``) in docs/RESULTS.md, and
the memory table of docs/GPU.md's recipe: what each part of a step holds at that shape, from the shape's
arithmetic, beside what the runs measured."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

from bench import common
from bench.gpu.engine_share import running_mean, split
from bench.gpu.planted import param_count
from bench.gpu.workload_rates import summarise
from bench.report.document import load_cited, repeat_of, results_of
from bench.report.format import cite, first_sentences, ms, num, pct, spread, table

SHAPE = "qwen2.5-7b"
GIB = 2**30


def _runs(results_dir: Path, repeats: bool = True) -> list[tuple[dict[str, Any], str, Path, dict[str, Any]]]:
    """Every 7B workload file (``gpu_workload_<gpu>_q7*.json``, with ``repeats`` those kept under repeats/ too):
    results, source, path, and the run's parameters."""
    paths = sorted(results_dir.glob("gpu_workload_*_q7*.json")) + (sorted(
        (results_dir / "repeats").glob("gpu_workload_*_q7*.json")) if repeats else [])
    out = []
    for path in paths:
        doc = json.loads(path.read_text())
        out.append((results_of(doc), cite(path, doc), path, doc.get("parameters", {})))
    return out


def _ours_where(results_dir: Path, **params: Any) -> list[tuple[dict[str, Any], str, dict[str, Any]]]:
    """The 7B files run with ``params`` (``optimizer="adamw_bf16"``: full fine-tuning; ``share_base=True``: the base
    held once): our sides, source and parameters."""
    return [(r.get(SHAPE, {}).get("ours", {}), source, args) for r, source, _, args in _runs(results_dir, repeats=False)
            if all(args.get(k) == v for k, v in params.items())]


def _full_runs(results_dir: Path) -> list[tuple[dict[str, Any], str, dict[str, Any]]]:
    """The 7B full fine-tuning files (``adamw_bf16``)."""
    return _ours_where(results_dir, optimizer="adamw_bf16")


def logged_steps(log: Path) -> list[list[float]]:
    """Step end times (seconds) per side, in the order a run log printed them (``step N ends at Xs``): the pace
    of a side the command's limit cut short before it wrote its figures."""
    sides: list[list[float]] = []
    for m in re.finditer(r"^step (\d+) ends at ([\d.]+)s$", log.read_text(), re.M):
        if m.group(1) == "1":
            sides.append([])
        if sides:
            sides[-1].append(float(m.group(2)))
    return sides


def seven_b_block(results_dir: Path) -> str:
    """LoRA at 7B, async (and what of sync was measured), one GPU: speed, pause, memory, MFU, reward."""
    lines = []
    for r, source, path, args in _runs(results_dir):
        side = r.get(SHAPE, {}).get("ours", {}).get("async_lora")
        if not side or side.get("partial"):
            continue
        warm = r[SHAPE]["warm_start"]
        plan, peak = max(side["memory_predicted_gib"]), max(side["memory_peak_gib"])
        what = "Repeat" if "repeats" in path.parts else "Run"
        base = "the frozen bf16 base"
        if args.get("share_base"):
            what, base = "Base held once (`--share-base`)", (f"the engine's own bf16 weights, mapped "
                                                             f"({num(side['base_shared_gib'], 1)} GiB the learner "
                                                             f"does not hold)")
        lines.append(
            f"- {what}: ours async, LoRA rank 32 on {base}, "
            f"{side['steps']} steps of 64 samples: **{num(side['completion_tokens_per_s'], 0)} trained completion "
            f"tokens/s** (mean length {num(side['trained_len_mean'], 0)}), publication pause "
            f"**{ms(side['publication_pause_s']['mean'])}** (largest {ms(side['publication_pause_s']['max'])}), "
            f"whole-GPU peak **{num(max(side['gpu_peak_used_gib']), 1)} GiB**, learner peak "
            f"{num(peak, 1)} GiB against the plan's {num(plan, 1)} (x{num(plan / peak)}), learner MFU "
            f"{pct(side['learner_mfu'])}, mean reward {num(statistics.mean(side['rewards']), 3)}, groups dropped as "
            f"stale {side['dropped'].get('stale', 0)} ({side['dropped'].get('unused_at_shutdown', 0)} left unused at "
            f"shutdown); policy planted in {num(warm['seconds'], 0)} s ({source}).")
        if share := share_line(side, r[SHAPE]["ours"].get("alone_lora")):
            lines.append(share)
        sync = r[SHAPE]["ours"].get("sync_lora")
        log = path.with_name(path.stem + "_run.log")
        if sync and not sync.get("partial"):
            lines.append(sync_line(sync, side, r.get("summary", {})))
        elif log.is_file():
            lines.append(sync_from_log(log, side))
        if trl := r[SHAPE].get("trl_lora"):
            lines.append(trl_line(trl, side, summarise(r)))
    if not lines:
        return "(no 7B result yet: `bash bench/gpu/run_7b.sh 570 lora`)"
    lines += [line for line in (pause_line(results_dir), full_line(results_dir)) if line]
    return "\n".join(lines + ["", missing_paragraph(results_dir)])


def missing_paragraph(results_dir: Path) -> str:
    """Issue 38's goals that the files do not meet, or that no file measures yet, and why where a figure says."""
    first = next((r[SHAPE] for r, _, _, _ in _runs(results_dir, repeats=False)
                  if r.get(SHAPE, {}).get("ours", {}).get("async_lora")), {})
    ours, ratios = first.get("ours", {}), summarise({SHAPE: first})
    out = []
    if (ratio := ratios.get(f"{SHAPE}/async_lora_over_sync_lora_tokens")) is not None and ratio < 2.0:
        sync = ours["sync_lora"]
        out.append(f"async ÷ sync is x{num(ratio)}, short of the 2.0 set for this shape. Sync's steps are "
                   f"{pct(sync['gen_s'] / sync['wall_s'])} generation, so hiding the learner gives at most "
                   f"x{num(sync['wall_s'] / sync['gen_s'])}, and the rest came from keeping the engine full; 2.0 "
                   f"would need a learner about as slow as generation.")
        if alone := ours.get("alone_lora"):
            # Async trains at most what its engine generates, and the engine generates at most what it does alone.
            bound = alone["tokens_per_s"] / sync["completion_tokens_per_s"]
            where = "" if alone.get("host") == sync.get("host") else " (on another machine of the same kind)"
            out.append(f"The engine alone, with nothing else on the GPU, generated {num(alone['tokens_per_s'], 0)} "
                       f"tokens/s at the producers' concurrency{where}: async can train no faster, so async ÷ sync "
                       f"is bounded by x{num(bound)} on this card" + (", and 2.0 is out of its reach." if bound < 2.0
                                                                     else ".") + f" Async trained "
                       f"{pct(ours['async_lora']['completion_tokens_per_s'] / alone['tokens_per_s'])} of it. "
                       + again_alone(results_dir, alone, sync) + budget_sentence(ours["async_lora"], sync, alone))
    trl = first.get("trl_lora")
    if not trl or not trl.get("steps"):
        out.append("TRL's side (`bash bench/gpu/run_7b.sh 570 trl`) has given no figure yet.")
    elif (over := ratios.get(f"{SHAPE}/async_lora_over_trl_lora" + ("_partial" if trl.get("partial") else "")
                             + "_tokens")) is not None and over < 3.0:
        out.append(f"Over TRL, x{num(over)} is short of the 3.0 set.")
    if trl and trl.get("rewards"):
        n, ours_r, trl_r = equal_step_rewards(ours["async_lora"], trl)
        if statistics.mean(trl_r) > statistics.mean(ours_r):
            out.append(f"Ours async's mean reward is below TRL's over the {n} steps both ran.")
    out += not_yet_run(results_dir)
    mfu = [side["learner_mfu"] for side in ours.values() if isinstance(side, dict) and "learner_mfu" in side]
    if mfu and max(mfu) < 0.45:
        out.append(f"Learner MFU is at most {pct(max(mfu))}, short of the 45% goal.")
    return "What is missing: " + " ".join(out) if out else "Every goal of this section is measured."


def not_yet_run(results_dir: Path) -> list[str]:
    """The GPU steps of ``run_7b.sh`` that no file holds a figure of yet, one sentence each."""
    runs = _runs(results_dir, repeats=False)
    out = []
    if not _ours_where(results_dir, share_base=True):
        passed = _gpu_test_passed(results_dir, "gpu_tests_shared_base_*.log")
        status = (f"passed its GPU test ({passed}) but has not run at 7B, so its whole-GPU peak is not measured "
                  "(`run_7b.sh 570 shared`)." if passed else
                  "has not run on a GPU (`run_7b.sh 570 shared`, after `pytest -m gpu tests/lora/test_lora_gpu.py`).")
        out.append(f"The base held once (`--share-base`: the learner maps the engine's weights) {status}")
    if not any((r.get(SHAPE, {}).get("ours", {}).get("alone_lora") or {}).get("adapter") for r, _, _, _ in runs):
        out.append("The engine alone has been measured without an adapter only, so the bound above leaves out the "
                   "adapter's kernels; `run_7b.sh 570 share` measures it serving one.")
    full = [(ours.get("async") or {}).get("steps", 0) for ours, _, _ in _full_runs(results_dir)]
    if max(full, default=0) < 24:
        out.append("Full fine-tuning has not run its 24 steps on an H200 (`run_7b.sh 570 full`, then `fullsync`).")
    if not any("adamw_bf16_compiled" in o for o, _ in _optimizer_runs(results_dir)):
        out.append("`adamw_bf16`'s compiled step is measured on the CPU only (BENCHMARKS.md), not yet on a GPU "
                   "(`run_7b.sh 570 optim`).")
    return out


def _gpu_test_passed(results_dir: Path, pattern: str) -> str | None:
    """Where a GPU test log matching ``pattern`` shows every test passed: the tests, the device line of its header
    and the file, for a citation; else None."""
    for path in sorted(results_dir.glob(pattern)):
        text = path.read_text()
        tests = re.findall(r"^(tests/\S+) PASSED", text, re.M)
        device = re.search(r"^# device: (.+)$", text, re.M)
        if tests and re.search(r"^=+ \d+ passed", text, re.M) and not re.search(r"\d+ (failed|error)", text):
            where = f", {device.group(1)}" if device else ""
            shown = path.relative_to(common.ROOT) if path.is_relative_to(common.ROOT) else path
            return f"`{'`, `'.join(tests)}`: log in `{shown}`{where}"
    return None


def share_line(side: dict[str, Any], alone: dict[str, Any] | None) -> str:
    """Where an async side's engine time went: its generation rate before the learner's first step, inside the
    learner's steps and between them (``bench.gpu.engine_share``), beside the engine alone where measured."""
    samples = side.get("engine_tokens_s")
    cut = split(samples, side["step_end_s"], side["learner_step_s"],
                alone["tokens_per_s"] if alone else None) if samples else None
    if cut is None:
        return ""
    names = {"fill": "before the learner's first step", "training": "while the learner trained",
             "between": "between its steps"}
    parts = [f"{what} {num(p['tokens_per_s'], 0)} tokens/s for {num(p['s'], 0)} s"
             + (f" ({pct(p['of_alone'])} of the engine alone)" if "of_alone" in p else "")
             + (f", {num(p['running'], 0)} requests running" if "running" in p else "")
             for name, what in names.items() if (p := cut[name])["tokens_per_s"] is not None]
    busy = cut["training"]["s"] / cut["span_s"]
    alone_running = running_mean((alone or {}).get("engine_tokens_s") or [])
    against = (f" The engine alone ran {num(alone_running, 0)} requests on average"
               + (", serving an adapter of zeros" if alone.get("adapter") else ", without an adapter") + "."
               if alone_running is not None else "")
    return (f"  Where the engine's time went (vLLM's generated-token counter against the learner's step windows): "
            f"{'; '.join(parts)}. The learner trained for {pct(busy)} of the run, each step taking "
            f"{num(statistics.mean(side['learner_step_s']), 1)} s on average.{against}")


def again_alone(results_dir: Path, alone: dict[str, Any], sync: dict[str, Any]) -> str:
    """The engine alone measured again in other 7B files (other machines of the kind): the bound's spread."""
    again = [(o["alone_lora"], source) for r, source, _, _ in _runs(results_dir, repeats=False)
             if (o := r.get(SHAPE, {}).get("ours", {})).get("alone_lora")
             and o["alone_lora"].get("host") != alone.get("host")]
    return "".join(f"Measured again on another machine, the engine alone"
                   f"{', serving an adapter of zeros,' if a.get('adapter') else ''} generated "
                   f"{num(a['tokens_per_s'], 0)} tokens/s, a bound of "
                   f"x{num(a['tokens_per_s'] / sync['completion_tokens_per_s'])} ({source}). " for a, source in again)


def budget_sentence(side: dict[str, Any], sync: dict[str, Any], alone: dict[str, Any]) -> str:
    """Async's wall time against what its two parts would take alone on the GPU: generating its tokens at the
    engine-alone rate, and training at sync's pace (sync's learner runs with the engine asleep or idle). The
    rest is time lost to sharing; the token counter's split (``share_line``), where recorded, says where."""
    gen = side["tokens_generated"] / alone["tokens_per_s"]
    learn = sync["learner_train_s"] * side["tokens_trained"] / sync["tokens_trained"]
    lost = side["wall_s"] - gen - learn
    out = (f"Of async's {num(side['wall_s'], 0)} s, generating its {side['tokens_generated']:,} tokens at the "
           f"engine-alone rate accounts for {num(gen, 0)} s, and training them at sync's pace for {num(learn, 0)} s; "
           f"beside the engine the learner's steps took {num(side['learner_train_s'], 0)} s "
           f"(x{num(side['learner_train_s'] / learn)}: the two processes take the GPU in turns). Taking turns with "
           f"nothing lost, the run would last {num(gen + learn, 0)} s; the other {num(lost, 0)} s "
           f"({pct(lost / side['wall_s'])}) were lost beyond that, to an engine below its alone rate (fewer "
           f"sequences in flight while producers wait on the staleness bound, the adapter's kernels, which the "
           f"engine alone did not run, switches between the processes) and to the pauses.")
    if not side.get("engine_tokens_s"):
        out += " This run predates the token counter (`bench.gpu.engine_share`) that splits those by phase."
    return out


def pause_line(results_dir: Path) -> str:
    """LoRA's pause against a full-weight publication's at 7B: the full-weight one is measured by the FP8 bench
    on an idle engine, so LoRA's is compared where its engine is idle too (the sync side publishes between
    steps); async's, in keep mode, also waits out the engine step in flight."""
    full = load_cited(results_dir / "fp8_h100_qwen25-7b.json")
    lora = next((r[SHAPE]["ours"] for r, _, _, _ in _runs(results_dir, repeats=False)
                 if (r.get(SHAPE, {}).get("ours", {}).get("sync_lora") or {}).get("steps")), None)
    if full is None or lora is None:
        return ""
    (r, source), idle, busy = full, lora["sync_lora"], lora["async_lora"]
    bf16 = r["rounds"][0]["bf16"]
    return (f"- Publication pause at 7B, LoRA against all the weights: a full-weight publication of the learner's "
            f"bf16 weights into an idle bf16 engine paused **{ms(bf16['publication_pause_median_s'])}** (median of "
            f"{', '.join(ms(x) for x in bf16['publication_pause_s'])}; {source}). LoRA's, into an idle engine (the "
            f"sync side publishes between steps): **{ms(idle['publication_pause_s']['mean'])}** mean, largest "
            f"{ms(idle['publication_pause_s']['max'])}; into a decoding engine (async, keep mode: the engine core "
            f"takes the update between its steps, so the pause includes the rest of the step in flight): "
            f"{ms(busy['publication_pause_s']['mean'])} mean. No full-weight pause into "
            f"a decoding 7B engine is measured to set beside that one.")


def full_line(results_dir: Path) -> str:
    """Full fine-tuning at 7B: what was run and where it stopped, and the optimiser's step against torch's."""
    parts, shares = [], []
    for ours, source, args in _full_runs(results_dir):
        if ours.get("error"):
            used = re.findall(r"has ([\d.]+) GiB memory in use", ours["error"])
            held = f": the learner held {used[0]} GiB, the engine {used[1]} GiB" if len(used) == 2 else ""
            parts.append(f"on an 80 GiB card it ran out of memory at its first optimiser step, as the memory "
                         f"table predicts{held} ({source})")
        elif (side := ours.get("async")) and side.get("steps"):
            parts.append(full_sides(side, ours.get("sync"), ours.get("alone"), args, source))
            shares.append(share_line(side, ours.get("alone")))
    for o, source in _optimizer_runs(results_dir):
        compiled = (f", compiled {num(o['adamw_bf16_compiled']['step_s'], 3)} s "
                    f"({num(o['compiled_step_ratio'], 1)}x the fused step)") if "adamw_bf16_compiled" in o else ""
        parts.append(f"`adamw_bf16`'s step over the 7B shape's parameters took {num(o['adamw_bf16']['step_s'], 2)} s "
                     f"eager{compiled}, against {num(o['torch_fused_adamw']['step_s'], 3)} s for torch's fused AdamW "
                     f"(eager x{num(o['step_ratio'], 0)}; {source})")
    if not parts:
        return ""
    return "\n".join([f"- Full fine-tuning (`adamw_bf16`): {'; '.join(parts)}.", *filter(None, shares)])


def full_sides(side: dict[str, Any], sync: dict[str, Any] | None, alone: dict[str, Any] | None,
               args: dict[str, Any], source: str) -> str:
    """Full fine-tuning's async side, and its sync side and the engine alone where they ran."""
    cut = " (cut short)" if side.get("partial") else ""
    out = (f"async, {side['steps']} steps{cut} of {args['batch_groups'] * args['n']} samples (answers of mean "
           f"{num(side['trained_len_mean'], 0)} tokens): **{num(side['completion_tokens_per_s'], 0)} trained "
           f"completion tokens/s**, whole-GPU peak **{num(max(side['gpu_peak_used_gib']), 1)} GiB**, learner peak "
           f"{num(side['learner_peak_allocated_gib'], 1)} GiB against the plan's "
           f"{num(max(side['memory_predicted_gib']), 1)}, MFU {pct(side['learner_mfu'])}, publication pause "
           f"{ms(side['publication_pause_s']['mean'])} mean, mean reward {num(statistics.mean(side['rewards']), 3)}, "
           f"groups dropped as stale {side['dropped'].get('stale', 0)} ({source})")
    if sync and sync.get("steps"):
        ratio = side["completion_tokens_per_s"] / sync["completion_tokens_per_s"]
        where = "the same machine" if sync.get("host") == side.get("host") else "another machine of the same kind"
        out += (f". Sync on {where}, the engine asleep (level 2) during each learner step: "
                f"{sync['steps']} steps, {num(sync['completion_tokens_per_s'], 0)} trained completion tokens/s, "
                f"MFU {pct(sync['learner_mfu'])}, sleep and wake "
                f"{num(sync['engine_sleep_s'] + sync['engine_wake_s'], 1)} s in all, whole-GPU peak "
                f"{num(max(sync['gpu_peak_used_gib']), 1)} GiB: async ran **x{num(ratio)}** "
                f"sync's trained tokens/s")
    if alone:
        out += (f". The engine alone at the producers' concurrency generated {num(alone['tokens_per_s'], 0)} tokens/s, "
                f"of which async trained {pct(side['completion_tokens_per_s'] / alone['tokens_per_s'])}")
    return out


def _optimizer_runs(results_dir: Path) -> list[tuple[dict[str, Any], str]]:
    """``bench.gpu.optimizer`` at the 7B shape, on any GPU."""
    return [x for path in sorted(results_dir.glob("optimizer_*_qwen25-7b.json")) if (x := load_cited(path))]


def sync_line(sync: dict[str, Any], async_side: dict[str, Any], summary: dict[str, float]) -> str:
    """The sync side measured whole, its ratio, and what bounds the ratio: the share of sync's wall spent
    generating (hiding the learner entirely saves at most the rest), and the engine's rate on each side."""
    ratio = summary[f"{SHAPE}/async_lora_over_sync_lora_tokens"]
    where = "the same machine" if sync.get("host") == async_side.get("host") else "another machine"
    apart = abs(async_side["trained_len_mean"] / sync["trained_len_mean"] - 1)
    return (f"  Sync, the same engine on {where}: {num(sync['completion_tokens_per_s'], 0)} trained completion "
            f"tokens/s (mean length {num(sync['trained_len_mean'], 0)}), learner MFU {pct(sync['learner_mfu'])}, "
            f"mean reward {num(statistics.mean(sync['rewards']), 3)}: async ran **x{num(ratio)}** sync's trained "
            f"tokens/s (x{num(summary[f'{SHAPE}/async_lora_over_sync_lora'])} samples/s), trained mean lengths "
            f"{pct(apart)} apart. Sync spent {num(sync['gen_s'], 0)} of its {num(sync['wall_s'], 0)} s generating "
            f"({pct(sync['gen_s'] / sync['wall_s'])}) and {num(sync['learner_train_s'], 0)} s training: hiding the "
            f"learner alone gives at most x{num(sync['wall_s'] / sync['gen_s'])}. The rest is the engine kept full: "
            f"sync's made {num(sync['tokens_generated'] / sync['gen_s'], 0)} tokens/s while it generated (each "
            f"step waits for its longest answer), async's {num(async_side['generated_tokens_per_s'], 0)} over the "
            f"whole run, beside the learner.")


def trl_line(trl: dict[str, Any], async_side: dict[str, Any], summary: dict[str, float]) -> str:
    """TRL's GRPOTrainer with PEFT LoRA and vLLM colocated, beside ours async: its rate, the ratio, the rewards
    (a side the command's limit cut short is compared over the steps it ran)."""
    who = "TRL GRPOTrainer with PEFT LoRA (same rank, targets and learning rate), vLLM colocated on the same GPU"
    if "error" in trl or not trl.get("steps"):
        return f"  {who}: no step ran. {first_sentences(trl.get('error', 'No error was recorded.'))}"
    key = f"{SHAPE}/async_lora_over_trl_lora" + ("_partial" if trl.get("partial") else "")
    cut = ", cut short by the command's limit" if trl.get("partial") else ""
    n, ours_r, trl_r = equal_step_rewards(async_side, trl)
    widest = max(statistics.stdev(ours_r), statistics.stdev(trl_r)) if n > 1 else 0.0
    gap = abs(statistics.mean(ours_r) - statistics.mean(trl_r))
    within = " (within the step-to-step spread)" if gap <= widest else ""
    return (f"  {who}: {trl['steps']} steps{cut}, {num(trl['completion_tokens_per_s'], 0)} trained completion "
            f"tokens/s (mean length {num(trl['completion_len_mean'], 0)}), whole-GPU peak "
            f"{num(max(trl['gpu_peak_used_gib']), 1)} GiB: ours async ran **x{num(summary[key + '_tokens'])}** "
            f"TRL's trained tokens/s (x{num(summary[key])} samples/s). Mean reward over the {n} steps both ran: ours "
            f"{spread(ours_r)} against TRL's {spread(trl_r)}{within}.")


def equal_step_rewards(ours: dict[str, Any], trl: dict[str, Any]) -> tuple[int, list[float], list[float]]:
    """Both sides' per-step rewards over the steps both ran (both draw the prompts in the same order), so a side
    cut short is compared with the other's first steps, not with its whole run (rewards rise as a run trains)."""
    n = min(len(ours["rewards"]), len(trl["rewards"]))
    return n, ours["rewards"][:n], trl["rewards"][:n]


def sync_from_log(log: Path, async_side: dict[str, Any]) -> str:
    """The sync side's pace from the run log, when the command's limit cut it short before it wrote a figure."""
    sides = logged_steps(log)
    if len(sides) < 2:
        return f"  Sync: no step logged (`{log.relative_to(common.ROOT)}`)."
    sync, marks = sides[-1], async_side["step_end_s"]
    per_sync = (sync[-1] - sync[0]) / (len(sync) - 1)
    per_async = (marks[-1] - marks[1]) / (len(marks) - 2)
    return (f"  Sync on the same engine was cut short by the command's limit after {len(sync)} of "
            f"{async_side['steps']} steps: {num(per_sync, 1)} s a step after its first, against async's "
            f"{num(per_async, 1)} s after its second, so async ran **x{num(per_sync / per_async)}** sync's samples/s "
            f"over those steps (step times from `{log.relative_to(common.ROOT)}`; no token figure for sync).")


# ---------------------------------------------------------------------------------------------- memory table


def memory_block(results_dir: Path) -> str:
    """What each part of a 7B step holds, LoRA and full fine-tuning, against an 80 GiB H100 and a 141 GiB H200."""
    found = [(r, source, args) for r, source, _, args in _runs(results_dir, repeats=False)
             if (r.get(SHAPE, {}).get("ours", {}).get("async_lora") or {}).get("steps")]
    if not found:
        return "(no 7B result yet: `bash bench/gpu/run_7b.sh 570 lora`)"
    r, source, args = found[0]
    side, total = r[SHAPE]["ours"]["async_lora"], param_count(SHAPE)
    weights = 2 * total / GIB
    adapter = side["trainable_params"] * 4 / GIB
    kv = args["kv_cache_gib"]
    engine_measured = max(side["gpu_peak_used_gib"]) - side["learner_peak_allocated_gib"]
    activations = max(side["memory_peak_gib"]) - weights - 4 * adapter
    # Index 3 on are added to the engine's measured bytes: the shadows are the engine's, but only full fine-tuning
    # (the cuda_ipc transport) allocates them, so the LoRA run's measure holds none.
    lora = [engine_measured, weights, kv, 0.0, weights + adapter, adapter, 2 * adapter, 0.0, activations]
    full = [engine_measured, weights, kv, weights, weights, weights, 2 * weights, weights, activations]

    def cell(x: float) -> str:
        return num(x, 1)

    names = ["engine in all, measured: the whole GPU's peak less the learner's allocated peak (weights, KV "
             "cache, CUDA graphs, LoRA slots, CUDA contexts)", "of which weights (bf16)",
             "of which KV cache (as configured)",
             "engine's shadow weights (full: each publication is staged into them while the engine generates; "
             "LoRA: none)",
             "learner weights (bf16; LoRA: + float32 adapter)", "gradients (LoRA: the adapter's, float32)",
             "optimiser state (AdamW: two; full: bf16 `adamw_bf16`)",
             "publication snapshot (full: the CUDA IPC buffer; LoRA: in host memory)",
             "activation peak, measured with LoRA (the same micro-batches for full)"]
    full_run = next(((o["async"], a) for o, _, a in _full_runs(results_dir) if (o.get("async") or {}).get("steps")),
                    None)
    full_measured = "not measured"
    if full_run:
        full_side, full_args = full_run
        full_measured = (f"measured {cell(max(full_side['gpu_peak_used_gib']))}, with answers of mean "
                         f"{num(full_args['mean_answer'], 0)} tokens")
    # (head, parts, what was measured). With the base lent by the engine (``--share-base``), the learner holds the
    # adapter alone.
    columns = [("LoRA, async", lora, f"measured {cell(max(side['gpu_peak_used_gib']))}")]
    shared = next((o["async_lora"] for o, _, _ in _ours_where(results_dir, share_base=True)
                   if (o.get("async_lora") or {}).get("steps")), None)
    if shared:
        held_once = [engine_measured, weights, kv, 0.0, adapter, adapter, 2 * adapter, 0.0, activations]
        columns.append(("LoRA, async, base held once", held_once, f"measured {cell(max(shared['gpu_peak_used_gib']))}"))
    columns.append(("full fine-tuning, async", full, full_measured))
    rows = [[n, *(cell(parts[i]) for _, parts, _ in columns)] for i, n in enumerate(names)]
    totals = [engine_measured + sum(parts[3:]) for _, parts, _ in columns]
    rows.append(["**whole GPU** (engine process + learner)",
                 *(f"**{cell(t)}** ({measured})" for t, (_, _, measured) in zip(totals, columns))])
    rows.append(["fits an 80 GiB H100 / a 141 GiB H200 (75 / 134 GiB usable)", *map(fits, totals)])
    note = (f"GiB, Qwen2.5-7B shape ({total / 1e9:.2f}B parameters), LoRA rank 32 "
            f"({side['trainable_params'] / 1e6:.1f}M adapter parameters). Shape arithmetic for the weights, gradients, "
            f"states, shadows and snapshot; the engine process and the activation peak are what the LoRA run measured "
            f"(the full column reuses them: its engine and micro-batches are the same)"
            + ("; base held once: the learner holds the adapter alone, its frozen parameters mapped onto the engine's "
               "weights (`asyncrl.lora.share_base`)" if shared else "") + f". Source: {source}.")
    return "\n".join([*table(["part", *(head for head, _, _ in columns)], rows), "", note])


def fits(total: float) -> str:
    # Usable memory: what torch reports free on an idle card, less the 5 GiB the issue keeps in reserve.
    return " / ".join("yes" if total <= usable else "no" for usable in (75.0, 134.0))


def fp8_paragraph(results_dir: Path) -> str:
    """FP8 against bf16 decode at 7B, at each concurrency the file measured, and the pause into each."""
    x = load_cited(results_dir / "fp8_h100_qwen25-7b.json")
    if x is None:
        return ""
    r, source = x
    fp8, bf16 = r["rounds"][0]["fp8"], r["rounds"][0]["bf16"]
    by_seqs = fp8.get("decode_tokens_per_s_by_seqs", {})
    at = "; ".join(f"**x{num(r['decode_speedup_median_by_seqs'][n], 3)}** with {n} sequences decoding at once "
                   f"({num(by_seqs[n], 0)} against {num(bf16['decode_tokens_per_s_by_seqs'][n], 0)} tokens/s)"
                   for n in sorted(by_seqs, key=int))
    earlier = repeat_of(results_dir / "fp8_h100_qwen25-7b.json")
    again = (f", x{num(results_of(earlier[0])['decode_speedup_median'], 3)} in an earlier run of the same engines "
             f"(`{earlier[1].relative_to(common.ROOT)}`)") if earlier else ""
    return (f"\n\nAt the 7B shape on one H100, FP8 decodes at {at}; and x{num(r['decode_speedup_median'], 3)} "
            f"with 256{again}. FP8 weights halve the bytes each decode step reads: that pays while reading the "
            f"weights bounds a step, at tens of sequences; at 256 the step is bound elsewhere and FP8 gains "
            f"nothing. "
            f"A publication of the learner's bf16 weights (staged from host memory) paused "
            f"{ms(fp8['publication_pause_median_s'])} into FP8 against {ms(bf16['publication_pause_median_s'])} "
            f"into bf16 (medians of {len(fp8['publication_pause_s'])}) ({source}).")
