"""A picture of a logged run, from the rollout log alone: staleness, completion lengths, behaviour log-probs and
rewards per step (means, with the range of the batch where it says more)."""

from __future__ import annotations

from pathlib import Path

from asyncrl.rollout_log import StepRecord, read


def step_summary(record: StepRecord) -> dict[str, float]:
    """One step's plotted values: staleness (mean, max), completion length (mean, max), mean behaviour log-prob
    per model token, reward mean, groups dropped since the previous step."""
    rollouts = [(g, r) for g in record.groups for r in g.rollouts]
    lengths = [r.sample.num_model_tokens for _, r in rollouts]
    logprobs = [lp for _, r in rollouts for lp, m in zip(r.sample.logprobs, r.sample.loss_mask or
                                                         (1,) * len(r.sample.logprobs)) if m]
    staleness = [g.staleness(record.policy_version) for g in record.groups]
    return {"step": record.step, "staleness_mean": sum(staleness) / len(staleness), "staleness_max": max(staleness),
            "length_mean": sum(lengths) / len(lengths), "length_max": max(lengths),
            "logprob_mean": sum(logprobs) / len(logprobs) if logprobs else 0.0,
            "reward_mean": sum(r.reward for _, r in rollouts) / len(rollouts),
            "dropped": sum(record.drops.values())}


def plot_log(directory: str | Path, out: str | Path) -> Path:
    """Write a PNG of the run logged in ``directory`` to ``out`` (needs matplotlib, the ``replay`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [step_summary(r) for r in read(directory)]
    if not rows:
        raise ValueError(f"the rollout log in {directory} holds no whole step")
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    panels = [(axes[0][0], "staleness (versions)", ("staleness_mean", "staleness_max")),
              (axes[0][1], "completion length (model tokens)", ("length_mean", "length_max")),
              (axes[1][0], "behaviour log-prob per token (nats)", ("logprob_mean",)),
              (axes[1][1], "reward, groups dropped", ("reward_mean", "dropped"))]
    for ax, title, keys in panels:
        for key in keys:
            ax.plot(steps, [r[key] for r in rows], label=key)
        ax.set_title(title)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("learner step")
    fig.suptitle(f"rollout log {Path(directory).name}: steps {steps[0]}..{steps[-1]}")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
