"""Sections side by side with TRL: ``bench.peers.vs_trl`` and the GPU workload (``bench.gpu.workload``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.gpu.workload_rates import TRL_LABELS, over_fastest_trl, summarise
from bench.report.format import first_sentences, num, pct, table


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


_SIDES = (("ours", "async", "ours, async (colocated)"), ("ours", "sync", "ours, sync"),
          ("ours", "async_fp8", "ours, async, FP8 rollouts"), ("ours", "async_lora", "ours, async, LoRA"),
          ("ours", "sync_lora", "ours, sync, LoRA"), *((mode, None, label) for mode, label in TRL_LABELS.items()),
          ("trl_lora", None, "TRL GRPOTrainer + PEFT LoRA, vLLM colocate"))


def gpu_workload(r: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for shape, x in r.items():
        if shape == "summary" or not isinstance(x, dict):
            continue
        rows = []
        for key, sub, label in _SIDES:
            side = x.get(key, {}).get(sub) if sub else x.get(key)
            if side and "samples_per_s" in side:
                label += " (cut short: steps so far)" if side.get("partial") else ""
                rows.append([label, f"**{num(side['samples_per_s'], 1)}**", num(side.get("samples_per_s_steady"), 1),
                             num(side["completion_tokens_per_s"], 0), num(side["completion_len_mean"], 0),
                             num(sum(side["rewards"]) / len(side["rewards"]), 3), num(side.get("learner_train_s"), 1)])
        lines += [f"**{shape}** ({num(x['warm_start'].get('params', 0) / 1e6, 0)}M parameters; ours' learner: "
                  f"{_learner_options(x)})", ""]
        lines += table(["side", "trained samples/s", "steady", "completion tokens/s", "mean length",
                        "mean reward", "ours: learner s"], rows) + [""]
        for key, engine in (("alone", "The engine alone"), ("alone_lora", "The LoRA-serving engine alone, no adapter")):
            if alone := x.get("ours", {}).get(key):
                lines += [f"{engine}, nothing else on the GPU: {num(alone['tokens_per_s'], 0)} tokens/s over "
                          f"{alone['groups']} groups at the producers' concurrency.", ""]
        for who, side in x.items():  # a side whose run failed before it wrote figures
            if isinstance(side, dict) and side.get("error"):
                lines += [f"{who} failed: {first_sentences(side['error'])}", ""]
        lines += _token_books(x.get("ours", {}))
    summary = summarise(r)  # from the sides' figures, so files from before _tokens get it too

    def ratios(tokens: bool) -> str:
        return ", ".join(f"{k.split('/')[-1].removesuffix('_tokens')} {num(v)}x" for k, v in summary.items()
                         if k.endswith("_tokens") == tokens and not k.endswith("_steady")
                         and "generation_limit" not in k) or "none (one side)"

    return lines + [f"Ratios over the whole run, trained samples/s: {ratios(False)}.",
                    f"Completion tokens/s: {ratios(True)}. Where a side trains shorter completions than "
                    "another (mean length), its samples/s ratio flatters it; the tokens/s ratio does not."]


def _token_books(ours: dict[str, Any]) -> list[str]:
    """Where ours' generated tokens went (files from before the admission work record none)."""
    rows = [[mode, num(side["tokens_generated"], 0), num(side["tokens_trained"], 0),
             num(100 * side["tokens_trained"] / side["tokens_generated"], 1) + "%",
             ", ".join(f"{k} {num(v, 0)}" for k, v in side["tokens_dropped"].items() if v) or "none",
             num(side["generated_len_mean"], 1), num(side["trained_len_mean"], 1),
             "on" if side["admission"] else "off", side["correction"]]
            for mode in ("async", "sync", "async_fp8", "async_lora", "sync_lora")
            if "tokens_trained" in (side := ours.get(mode, {}))]
    if not rows:
        return []
    return table(["ours", "completion tokens generated", "trained", "share", "dropped (tokens, by reason)",
                  "generated mean length", "trained mean length", "admission", "correction"], rows) + [""]


def _learner_options(x: dict[str, Any]) -> str:
    # Files from before ``--learner`` have no options recorded: their learner ran 8-rollout padded micro-batches.
    ours = x.get("ours", {})
    options = next((ours[m]["learner_options"] for m in ("async", "sync", "async_fp8", "async_lora", "sync_lora")
                    if "learner_options" in ours.get(m, {})), None)
    if not options:
        # A side that failed or was cut short writes no options either.
        cut = any(k.startswith("error") or (isinstance(v, dict) and v.get("partial")) for k, v in ours.items())
        return "not recorded" if cut else "padded rows, 8-rollout micro-batches"
    return ", ".join(f"{k}={v}" for k, v in options.items())


def workload_ratios(r: dict[str, Any]) -> str:
    """Ours async over TRL's fastest side, per shape: the rule the README's headline quotes too."""
    parts = [f"ours async over {TRL_LABELS[x[0]]}, samples/s **{num(x[1])}x**, tokens/s **{num(x[2])}x** ({shape})"
             for shape in r if (x := over_fastest_trl(r, shape))]
    return "; ".join(parts)


FORMATTERS: dict[str, tuple[str, str, Callable[[dict[str, Any]], list[str]]]] = {
    "vs_trl": ("Against TRL", "Trained samples/s side by side in one run.", vs_trl),
    "gpu_workload": ("GPU workload: long-tailed completions, side by side", "Trained samples/s at equal samples, "
                     "side by side in one run.", gpu_workload),
}
