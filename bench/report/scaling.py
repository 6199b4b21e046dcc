"""Sections on scaling out: the FSDP2 learner across ranks, and the simulated many-server run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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


FORMATTERS: dict[str, tuple[str, str, Callable[[dict[str, Any]], list[str]]]] = {
    "distributed": ("FSDP2 learner across ranks", "Learner tokens/s on 1 and 2 ranks (torchrun, FSDP2, bf16).",
                    distributed),
    "scaling_sim": ("Scale-out simulation", "Fake engines in Ray actors: ingest into one learner, and the "
                    "publication fan-out as servers are added.", scaling_sim),
}
