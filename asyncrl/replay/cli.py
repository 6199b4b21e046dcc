"""``asyncrl replay LOG --checkpoint DIR`` and ``asyncrl plot LOG --out run.png``: the replay and the plot as
commands (``python -m asyncrl.replay`` too).

The model's architecture comes from ``--model``, else the ``model_dir`` the log's header records
(``RolloutLogConfig.model_dir``); the learner and loss settings from the header, with ``--correction``,
``--is-cap``, ``--is-level`` and ``--m2-threshold`` changing the loss for a counterfactual. A run that trained a loss
of its own is replayed through the library call (``asyncrl.replay.replay(..., loss=...)``)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from pathlib import Path

import torch

from asyncrl.algorithms.corrections import Correction
from asyncrl.algorithms.losses import IsLevel
from asyncrl.replay.learner import load_logged_model, logged_loss_config, replay
from asyncrl.replay.plot import plot_log
from asyncrl.rollout_log import header


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="asyncrl", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("replay", help="train from a checkpoint on the logged batches, with no engine")
    r.add_argument("log", type=Path, help="the rollout log's directory (RolloutLogConfig.dir)")
    r.add_argument("--checkpoint", type=Path, required=True, help="a checkpoint directory (.../step-NNNNNN)")
    r.add_argument("--model", type=Path, help="HF model directory (default: the header's model_dir)")
    r.add_argument("--until", type=int, help="last step to replay (default: the log's last)")
    r.add_argument("--correction", choices=[c.value for c in Correction], help="another off-policy correction")
    r.add_argument("--is-cap", type=float, help="another importance-weight cap")
    r.add_argument("--is-level", choices=[c.value for c in IsLevel], help="another importance-weight level")
    r.add_argument("--m2-threshold", type=float, help="another M2PO threshold")
    r.add_argument("--torch-threads", type=int, help="CPU threads (default: the run's, which bit-identical needs)")
    r.add_argument("--out", type=Path, help="each replayed step's metrics as JSON lines (beside the logged ones)")
    r.add_argument("--save", type=Path, help="save the replayed weights here (safetensors)")
    pl = sub.add_parser("plot", help="staleness, lengths, log-probs and rewards over the run, as a PNG")
    pl.add_argument("log", type=Path)
    pl.add_argument("--out", type=Path, required=True, help="PNG to write")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "plot":
        print(plot_log(args.log, args.out))
        return 0
    changes = {k: v for k, v in {"correction": args.correction, "is_cap": args.is_cap, "is_level": args.is_level,
                                 "m2_threshold": args.m2_threshold}.items() if v is not None}
    loss_config = dataclasses.replace(logged_loss_config(args.log), **changes) if changes else None
    threads = args.torch_threads or header(args.log).get("torch_threads")
    if threads:
        torch.set_num_threads(threads)
    model = load_logged_model(args.log, args.model)
    with args.out.open("w") if args.out else contextlib.nullcontext(None) as out:
        result = replay(args.log, args.checkpoint, model=model, loss_config=loss_config, until=args.until,
                        metrics_out=out)
    if args.save:
        from safetensors.torch import save_model

        args.save.parent.mkdir(parents=True, exist_ok=True)
        save_model(result.model, str(args.save))
    print(json.dumps({"from_step": result.start_step, "to_step": result.last_step, "steps": result.steps,
                      "loss_changes": changes, "out": str(args.out) if args.out else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
