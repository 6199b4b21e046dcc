"""Sections on the engine and the learner on a GPU: sleep mode, engine start-up, the learner's speed and MFU,
a profiled step, and the host costs behind it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.report.format import ms, num, pct, table


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


def lora_sides(r: dict[str, Any]) -> list[str]:
    """LoRA against full fine-tuning, per shape: one row per side, then LoRA over full."""
    rows, notes = [], []
    for shape, e in r["shapes"].items():
        for side in ("full", "lora"):
            x = e.get(side)
            if not x:
                continue
            pause = x.get("publication_pause_s") or {}
            rows.append([shape, side, f"{num(x['trainable_params'] / 1e6, 1)}M", ms(pause.get("mean")),
                         ms(pause.get("max")), f"{num(x['learner_peak_allocated_gib'], 1)} GiB",
                         f"{num(max(x['gpu_peak_used_gib']), 1)} GiB" if x.get("gpu_peak_used_gib") else "-",
                         num(x["samples_per_s"], 1), num(x.get("samples_per_s_steady"), 1),
                         num(x["completion_tokens_per_s"], 0), num(x.get("completion_tokens_per_s_steady"), 0),
                         num(sum(x["rewards"]) / len(x["rewards"]), 3) if x.get("rewards") else "-"])
        missing = [side for side in ("full", "lora") if side not in e]
        if missing:
            notes.append(f"{shape}: no {' or '.join(missing)} side in this file: the command was stopped (its time "
                         f"limit) before that side finished, so there is no LoRA-over-full figure for this shape.")
        if (v := e.get("lora_over_full")) is not None:
            notes.append(f"{shape}, LoRA over full: publication pause **{num(v['publication_pause_mean'], 3)}x**, "
                         f"learner peak memory **{num(v['learner_peak_allocated'])}x**, trained samples/s "
                         f"**{num(v['samples_per_s'])}x** (steady {num(v['samples_per_s_steady'])}x), completion "
                         f"tokens/s **{num(v['tokens_per_s'])}x** (steady {num(v['tokens_per_s_steady'])}x).")
    return table(["shape", "side", "trainable", "pause mean", "pause max", "learner peak", "GPU peak", "samples/s",
                  "steady", "tokens/s", "steady", "reward"], rows) + ([""] + notes if notes else [])


def fp8(r: dict[str, Any]) -> list[str]:
    """Per round and engine: decode tokens/s at the file's concurrencies, the pause, the start; then FP8 / bf16."""
    extra = sorted({int(n) for round_ in r["rounds"] for side in round_.values()
                    for n in side.get("decode_tokens_per_s_by_seqs", {})})
    rows = [[f"{i + 1}", name, side["precision"],
             *(num(side["decode_tokens_per_s_by_seqs"][str(n)], 0) for n in extra),
             num(side["decode_tokens_per_s"], 0), ms(side["publication_pause_median_s"]), num(side["start_s"], 1)]
            for i, round_ in enumerate(r["rounds"]) for name, side in round_.items()]
    decode = [f"decode tokens/s, {n} sequences" for n in extra] + [f"decode tokens/s{', 256 sequences' * bool(extra)}"]
    ratios = "".join(f"decode at {n} sequences **{num(x, 3)}x**, "
                     for n, x in sorted(r.get("decode_speedup_median_by_seqs", {}).items(), key=lambda kv: int(kv[0])))
    return table(["round", "engine", "samples in", *decode, "publication pause (median)", "start s"], rows) + [
        "", f"FP8 / bf16: {ratios}decode{' at 256 sequences' * bool(extra)} **{num(r['decode_speedup_median'], 3)}x**"
            f", publication pause **{num(r['pause_ratio_median'], 3)}x** (medians over rounds)."]


def optimizer(r: dict[str, Any]) -> list[str]:
    """Step times (and on a GPU, memory) of adamw_bf16 eager and compiled against torch's fused AdamW."""
    sides = [("adamw_bf16", "`adamw_bf16` (StochasticAdamW), eager"),
             ("adamw_bf16_compiled", "`adamw_bf16`, compiled"),
             ("torch_fused_adamw", "torch AdamW, fused (bf16 states, round to nearest)")]
    rows = [[label, num(x["step_s"], 3), num(x.get("first_step_s"), 1), num(x.get("held_gib"), 1),
             num(x.get("temporary_gib"), 2), num(x.get("planned_temporary_gib"), 2)]
            for key, label in sides if (x := r.get(key))]
    lines = [f"{num(r['params'] / 1e9, 2)}B parameters; `adamw_bf16` eager / fused: **{num(r['step_ratio'], 1)}x** "
             "the step time"]
    if "compiled_speedup" in r:
        lines.append(f"compiled / fused: **{num(r['compiled_step_ratio'], 1)}x**; compiling made the step "
                     f"**x{num(r['compiled_speedup'], 1)}** faster")
    if (a := r.get("agreement")) is not None:
        lines.append(f"the same three steps on CPU and GPU: {pct(a['equal_fraction'])} of weights equal to the bit "
                     f"({pct(a['moved_fraction'])} moved)")
    return table(["optimiser", "step s", "first step s (states; compile)", "held GiB", "temporaries GiB",
                  "planned temporaries GiB"], rows) + ["", "; ".join(lines) + "."]


FORMATTERS: dict[str, tuple[str, str, Callable[[dict[str, Any]], list[str]]]] = {
    "fp8": ("FP8 rollouts against bf16", "bench/gpu/fp8.py: one bf16 checkpoint served in bf16 and in FP8 (vLLM's "
            "online quantization), decode speed with ignore_eos, and the pause of a full-weight publication of the "
            "learner's bf16 weights into each (CUDA IPC, KEEP).", fp8),
    "optimizer": ("`adamw_bf16` against torch's fused AdamW", "bench/gpu/optimizer.py: one optimiser step over "
                  "a shape's bf16 parameters and random gradients, eager and compiled, and on a GPU the memory it "
                  "holds and allocates besides.",
                  optimizer),
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
    "lora": ("LoRA against full fine-tuning", "bench/gpu/lora.py: ours async on one GPU, the same shape, task and "
             "settings, once training every weight and once a LoRA adapter published alone (its own engine each); "
             "pause per publication, the learner's peak GPU memory (its torch allocations) and the whole GPU's "
             "(the engine's included), trained samples/s and completion tokens/s.",
             lora_sides),
}
