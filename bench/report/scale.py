"""Formatters for the scale-out, GPU-workload and multi-turn result files (the rest of ``bench.report``'s
sections): one function per benchmark, each turning a file's ``results`` into Markdown lines."""

from __future__ import annotations

from typing import Any

from bench.gpu.workload_rates import TRL_LABELS, summarise
from bench.report.format import ms, num, pct, table


def distributed(r: dict[str, Any]) -> list[str]:
    learner = r.get("learner", {})
    rows = [[str(x["ranks"]), num(x["step_s"], 3), num(x["tokens_per_step"], 0), f"**{num(x['tokens_per_s'], 0)}**"]
            for k, x in sorted(learner.items()) if k.startswith("ranks_")]
    lines = table(["ranks", "step s", "tokens/step", "learner tokens/s"], rows)
    if "speedup_2_vs_1" in learner:
        lines += ["", f"2 ranks over 1: **{num(learner['speedup_2_vs_1'])}x** (goal 1.8x)."]
    if "publication" in r:
        lines += ["", f"Publication: {r['publication']}"]
    return lines


def scaling_sim(r: dict[str, Any]) -> list[str]:
    ingest = [[str(x["servers"]), str(x["producers"]), num(x["groups_per_s"], 0), num(x["tokens_per_s"], 0),
               pct(x["paused_frac"])] for x in r["ingest"]]
    fan = [[str(x["servers"]), num(x["payload_mib"], 0), ms(x["pause_s_median"]), ms(x["transfer_s_median"]),
            ms(x["resume_s_median"]), f"**{ms(x['total_s_median'])}**"] for x in r["fan_out"]]
    return (table(["servers", "producers", "groups/s into the queue", "tokens/s", "time paused"], ingest) + [""]
            + table(["servers", "payload MiB", "pause", "transfer", "resume", "paused in all (median)"], fan)
            + ["", str(r.get("notes", ""))])


_SIDES = (("ours", "async", "ours, async (colocated)"), ("ours", "sync", "ours, sync"),
          *((mode, None, label) for mode, label in TRL_LABELS.items()))


def gpu_workload(r: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for shape, x in r.items():
        if shape == "summary" or not isinstance(x, dict):
            continue
        rows = []
        for key, sub, label in _SIDES:
            side = x.get(key, {}).get(sub) if sub else x.get(key)
            if side:
                rows.append([label, f"**{num(side['samples_per_s'], 1)}**", num(side.get("samples_per_s_steady"), 1),
                             num(side["completion_tokens_per_s"], 0), num(side["completion_len_mean"], 0),
                             num(sum(side["rewards"]) / len(side["rewards"]), 3), num(side.get("learner_train_s"), 1)])
        lines += [f"**{shape}** ({num(x['warm_start'].get('params', 0) / 1e6, 0)}M parameters; ours' learner: "
                  f"{_learner_options(x)})", ""]
        lines += table(["side", "trained samples/s", "steady", "completion tokens/s", "mean length",
                        "mean reward", "ours: learner s"], rows) + [""]
        lines += _token_books(x.get("ours", {}))
    summary = summarise(r)  # from the sides' figures, so files from before _tokens get it too

    def ratios(tokens: bool) -> str:
        return ", ".join(f"{k.split('/')[-1].removesuffix('_tokens')} {num(v)}x" for k, v in summary.items()
                         if k.endswith("_tokens") == tokens and not k.endswith("_steady")
                         and "generation_limit" not in k)

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
            for mode in ("async", "sync") if "tokens_trained" in (side := ours.get(mode, {}))]
    if not rows:
        return []
    return table(["ours", "completion tokens generated", "trained", "share", "dropped (tokens, by reason)",
                  "generated mean length", "trained mean length", "admission", "correction"], rows) + [""]


def _learner_options(x: dict[str, Any]) -> str:
    # Files from before ``--learner`` have no options recorded: their learner ran 8-rollout padded micro-batches.
    ours = x.get("ours", {})
    options = next((ours[m]["learner_options"] for m in ("async", "sync") if "learner_options" in ours.get(m, {})),
                   None)
    if not options:
        return "padded rows, 8-rollout micro-batches"
    return ", ".join(f"{k}={v}" for k, v in options.items())


def sleep_mode(r: dict[str, Any]) -> list[str]:
    rows = [[str(x["level"]), num(x["kv_cache_gib"], 1), num(x["freed_gib"], 2), ms(x["sleep_s"]),
             ms(x["wake_and_update_s"]), ms(x["update_paused_s"])] for x in r.values()]
    return table(["level", "KV cache GiB", "GPU memory freed GiB", "sleep", "wake + update", "update paused"], rows)


def startup(r: dict[str, Any]) -> list[str]:
    keys = ("import_s", "spawn_s", "load_s", "compile_total_s", "graph_capture_s", "profile_kv_warmup_s",
            "init_engine_s", "start_s")
    rows = [[f"{x['variant']} ({x['cache']} cache)"] + [num(x.get(k), 1) for k in keys]
            + [num(x.get("decode_tokens_per_s"), 0)] for x in r["runs"]]
    return table(["variant", "import", "spawn", "load", "compile", "graphs", "profile+KV", "init engine",
                  "**start s**", "decode tokens/s"], rows)


def tool_use(r: dict[str, Any]) -> list[str]:
    rows = [[str(x["seed"]), pct(x["accuracy_before"]), f"**{pct(x['accuracy_after'])}**", pct(x["tool_rate_before"]),
             pct(x["tool_rate_after"]), num(x["rl_wall_s"], 0)] for x in r["runs"]]
    s = r["summary"]
    return table(["seed", "accuracy before", "after", "tool-call rate before", "after", "RL s"], rows) + [
        "", f"Mean over {len(rows)} seeds: accuracy {pct(s['accuracy_before']['mean'])} -> "
            f"**{pct(s['accuracy_after']['mean'])}** (min {pct(s['accuracy_after']['min'])}), tool-call rate "
            f"{pct(s['tool_rate_before']['mean'])} -> {pct(s['tool_rate_after']['mean'])}."]


def learner_speed(r: dict[str, Any]) -> list[str]:
    # Files from before scoring from hidden states have no "scoring": they scored from the full logits; files
    # from before varlen attention and compiled modules have neither.
    rows = [["packed" if x["packing"] else "padded", "varlen" if x.get("varlen") else "sdpa",
             compiled_kind(x), num(x.get("micro_batch_tokens"), 0),
             "on" if x["grad_ckpt"] else "off", x.get("scoring", "logits"),
             num(x["step_s"], 3),
             num(x["tokens_per_step"], 0), num(x["computed_tokens_per_step"] / x["tokens_per_step"], 2),
             f"**{num(x['tokens_per_s'], 0)}**", f"**{pct(x['mfu'])}**", num(x.get("peak_memory_gib"), 1)]
            for x in r["runs"]]
    header = ["rows", "attention", "compiled", "micro-batch tokens", "grad ckpt", "log-probs from", "step s",
              "real tokens/step", "computed/real", "tokens/s", "MFU", "peak GiB"]
    return table(header, rows) + ["", f"Shape {r['shape']}; MFU = 6 x params x tokens/s / 989 TFLOP/s (H200 dense "
                                      "bf16); goal 40%."]


def compiled_kind(run: dict[str, Any]) -> str:
    """What a learner run compiled: whole decoder layers, the element-wise chains, or nothing."""
    return "layers" if run.get("compiled_layers") else "chains" if run.get("compiled") else "off"


def learner_profile(r: dict[str, Any]) -> list[str]:
    k, total = r["kernel_s"], r["kernel_total_s"]
    rows = [[kind, num(k[kind], 3), pct(k[kind] / total)] for kind in ("matmul", "attention", "other")]
    return table(["kernels", "device s", "share"], rows) + [
        "", f"Step wall {num(r['step_wall_s'], 3)} s, kernels {num(total, 3)} s; MFU {pct(r['mfu'])}. If only the "
            f"matrix multiplies took time: **{pct(r['mfu_matmul_bound'])}** (the bound no fusion of the rest "
            "can pass at these matmul speeds)."]


def host_probe(r: dict[str, Any]) -> list[str]:
    c = r["cpu_ops"]
    rows = [[f"torch, {c['torch_threads']} threads (default)", num(c["torch_default_threads_us"], 0)],
            ["torch, 1 thread", num(c["torch_one_thread_us"], 0)], ["numpy", num(c["numpy_us"], 0)]]
    out = table(["CPU index maths on a row layout's scale", "us per call"], rows)
    if (m := r.get("matmul_launch")) is not None:
        rows = [["every call a new shape", num(m["new_shapes_us"], 1)], ["one shape", num(m["one_shape_us"], 1)],
                ["16 widths, first pass", num(m["16_widths_first_pass_us"], 1)],
                ["16 widths, again", num(m["16_widths_again_us"], 1)]]
        out += ["", *table(["bf16 matmul launches (device busy)", "host us per launch"], rows)]
    return out + ["", "Why the learner lays rows out in numpy and rounds a one-row micro-batch's width "
                      "(docs/ARCHITECTURE.md)."]


FORMATTERS = {
    "distributed": ("FSDP2 learner across ranks", "Learner tokens/s on 1 and 2 ranks (torchrun, FSDP2, bf16).",
                    distributed),
    "scaling_sim": ("Scale-out simulation", "Fake engines in Ray actors: ingest into one learner, and the "
                    "publication fan-out as servers are added.", scaling_sim),
    "gpu_workload": ("GPU workload: long-tailed completions against TRL", "Trained samples/s at equal samples, "
                     "side by side in one run.", gpu_workload),
    "sleep": ("Sleep mode", "vLLM sleep levels 1 and 2 on the GPU test model: memory freed, sleep, wake with a "
              "weight update, and the log-prob parity check passed.", sleep_mode),
    "startup_probe": ("Engine start-up on the GPU", "Where an engine start's seconds go, per variant (seconds).",
                      startup),
    "learner_speed": ("Learner speed and MFU", "LocalBackend steps on synthetic RL batches (completion lengths "
                      "vary 38-384 tokens, prompts 128), bf16 on one H200.", learner_speed),
    "learner_profile": ("Where a learner step's device time goes", "One profiled LocalBackend step, kernels "
                        "grouped by kind (bench/gpu/profile_learner.py).", learner_profile),
    "host_probe": ("Host costs behind a learner step", "bench/gpu/host_probe.py: matmul launches with new and "
                   "recurring shapes, and CPU index maths in torch and numpy.", host_probe),
    "tool_use": ("Multi-turn tool use", "examples/tool_use.py over seeds: held-out accuracy and tool-call rate "
                 "before and after RL.", tool_use),
}
