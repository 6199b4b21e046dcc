"""The learner's own speed: tokens/s and MFU of single-device training steps, padded or packed, with or
without gradient checkpointing, on synthetic RL batches (completion lengths vary, as sampled ones do).

    python -m bench.gpu.learner_speed --shape qwen2-0.5b                         # padded rows (the default)
    python -m bench.gpu.learner_speed --shape qwen2-0.5b --packing --grad-ckpt   # one variant
    python -m bench.gpu.learner_speed --shape qwen2-0.5b --all                   # all four, one file
    python -m bench.gpu.learner_speed --shape qwen2-0.5b --packing --micro-batch-tokens 16384 --scoring both
    python -m bench.gpu.learner_speed --shape qwen2-0.5b --ladder     # packed; + varlen; + compiled chains/layers
    python -m bench.gpu.learner_speed --shape tiny --cpu-smoke --out /tmp/bench  # a few seconds on CPU

The model is built in memory from its shape (random weights; no files, no hub). Each variant trains a fresh
copy with the same seed through ``LocalBackend``: warm-up steps (``--warm-batches``), then ``--steps`` timed
ones. Reported:
``tokens_per_s`` counts real forward tokens (prompt + completion of every rollout, padding excluded), so padded
and packed runs are comparable; ``computed_tokens_per_step`` is what the forward actually processed (padding
included); ``mfu = 6 * params * tokens_per_s / peak_flops`` (the usual dense estimate: attention FLOPs and
gradient checkpointing's recomputation are not counted as useful work). ``--peak-flops`` defaults to an
H200's dense bf16 peak (989e12). On a GPU it also reports the peak memory allocated. ``--scoring both`` runs each
variant twice, side by side: log-probs from the last hidden states (the learner's path) and from the model's
full logits (the path before it). ``--ladder`` adds the learner's speed options one at a time, side by side, on
packed token-sized micro-batches: sdpa with a block mask; variable-length attention (one row per micro-batch),
at 1x and 2x the micro-batch tokens; plus compiled element-wise chains (MLP, RMSNorm, log-prob head) at 1x, 2x
and 4x; compiled decoder layers instead at 2x and 4x (4x holds a whole default batch in one micro-batch). Two
compile warm-up steps (a full batch, a lone group) and ``--warm-batches`` full batches run before the timed
ones; each run records dynamo's graph breaks.
"""

from __future__ import annotations

import argparse
import dataclasses
import copy
import itertools
import time
from typing import Any

from bench import common
from bench.gpu.distributed import SHAPES

H200_BF16_DENSE_FLOPS = 989e12


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.parser(__doc__)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-0.5b")
    p.add_argument("--packing", action="store_true", help="LearnerConfig(packing=True)")
    p.add_argument("--grad-ckpt", action="store_true", help="LearnerConfig(gradient_checkpointing=True)")
    p.add_argument("--all", action="store_true", help="every packing x grad-ckpt combination")
    p.add_argument("--varlen", action="store_true", help="LearnerConfig(varlen_attention=True); needs --packing")
    p.add_argument("--compile", action="store_true", help="LearnerConfig(compile_elementwise=True)")
    p.add_argument("--compile-layers", action="store_true", help="LearnerConfig(compile_layers=True)")
    p.add_argument("--ladder", action="store_true",
                   help="packed rows: sdpa, varlen, varlen + compiled element-wise chains, varlen + compiled "
                        "layers, at several micro-batch token sizes")
    p.add_argument("--scoring", choices=("hidden", "logits", "both"), default="hidden",
                   help="log-probs from the last hidden states, chunked (the learner's path for transformers "
                        "decoders), or from the model's full logits (the path before it); both: side by side")
    p.add_argument("--steps", type=int, default=10, help="timed steps (after the warm-up)")
    p.add_argument("--warm-batches", type=int, default=8,
                   help="full batches trained before timing, after the compile warm-up: a long run's steady "
                        "state, in which a one-row micro-batch's rounded widths have been seen before")
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--completion-len", type=int, default=384, help="longest completion")
    p.add_argument("--min-completion-len", type=int, help="shortest completion (default: a tenth of the longest)")
    p.add_argument("--micro-batch-rollouts", type=int, default=16)
    p.add_argument("--micro-batch-tokens", type=int, help="micro-batches by tokens instead of rollouts")
    p.add_argument("--dtype", help="model dtype (default: bfloat16 on GPU, float32 on CPU)")
    p.add_argument("--attn", default="sdpa", help="transformers attention implementation (sdpa, eager, ...)")
    p.add_argument("--peak-flops", type=float, default=H200_BF16_DENSE_FLOPS,
                   help="the device's peak FLOP/s for the MFU denominator")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny batch, 2 timed steps")
    args = p.parse_args(argv)
    if args.ladder:
        args.packing, args.micro_batch_tokens = True, args.micro_batch_tokens or 16384
    if args.cpu_smoke:
        args.micro_batch_tokens = args.micro_batch_tokens and 256
        args.steps, args.groups, args.group_size, args.prompt_len, args.completion_len = 2, 4, 4, 8, 32
        args.warm_batches = 1
        args.micro_batch_rollouts = 8
    args.min_completion_len = args.min_completion_len or max(1, args.completion_len // 10)
    return args


def build(args: argparse.Namespace) -> Any:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(**SHAPES[args.shape], max_position_embeddings=4096, tie_word_embeddings=True,
                      attn_implementation=args.attn)
    dtype = getattr(torch, args.dtype or ("bfloat16" if common.on_gpu() else "float32"))
    return Qwen2ForCausalLM(cfg).to(dtype=dtype, device=common.learner_device())


def batch(args: argparse.Namespace, vocab: int, seed: int) -> list[Any]:
    """Groups with completion lengths drawn uniformly in [min, max] and mixed rewards (nothing inert)."""
    return common.synthetic_groups(args.groups, args.group_size, args.prompt_len,
                                   (args.min_completion_len, args.completion_len), vocab, seed)


def computed_tokens(groups: list[Any], cfg: Any) -> int:
    """Tokens the forward passes process for ``groups``, padding included (as ``LocalBackend`` cuts them)."""
    from asyncrl.actors.training import chunks
    from asyncrl.algorithms.logprobs import width_multiple
    from asyncrl.algorithms.rows import pack, round_up

    total = 0
    for part in chunks(groups, cfg.micro_batch_rollouts, cfg.micro_batch_tokens):
        lengths = [len(g.prompt.token_ids) + len(r.sample.token_ids) for g in part for r in g.rollouts]
        if cfg.varlen_attention:  # one row holding every sequence back to back, its width rounded up
            total += round_up(sum(lengths), width_multiple(sum(lengths)))
            continue
        rows = 1 + max(row for row, _ in pack(lengths, max(lengths))) if cfg.packing else len(lengths)
        total += rows * max(lengths)  # every row is as wide as the longest sequence
    return total


def variants(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The learner settings to time, in order, each as ``LearnerConfig`` keywords plus its scoring path."""
    if args.ladder:
        tokens = args.micro_batch_tokens
        elementwise, layers = {"compile_elementwise": True}, {"compile_layers": True}
        steps = [{}, {"varlen_attention": True}, {"varlen_attention": True, "micro_batch_tokens": 2 * tokens},
                 *({"varlen_attention": True, "micro_batch_tokens": k * tokens} | elementwise for k in (1, 2, 4)),
                 *({"varlen_attention": True, "micro_batch_tokens": k * tokens} | layers for k in (2, 4))]
        base = {"packing": True, "gradient_checkpointing": False, "micro_batch_tokens": tokens}
        return [base | v | {"scoring": "hidden"} for v in steps]
    pairs = [(p, c) for p in (False, True) for c in (False, True)] if args.all else [(args.packing, args.grad_ckpt)]
    scorings = ("logits", "hidden") if args.scoring == "both" else (args.scoring,)
    return [{"packing": p, "gradient_checkpointing": c, "micro_batch_tokens": args.micro_batch_tokens,
             "varlen_attention": args.varlen and p, "compile_elementwise": args.compile,
             "compile_layers": args.compile_layers, "scoring": s}
            for (p, c), s in itertools.product(pairs, scorings)]


def learner_config(args: argparse.Namespace, variant: dict[str, Any]) -> Any:
    from asyncrl.config import LearnerConfig

    return LearnerConfig(micro_batch_rollouts=args.micro_batch_rollouts, lr=1e-6,
                         **{k: v for k, v in variant.items() if k != "scoring"})


def backend_for(model: Any, cfg: Any) -> Any:
    """The learner both benches time: ``grpo_pipeline``'s default optimiser and the GRPO loss."""
    from asyncrl.actors.training import LocalBackend
    from asyncrl.algorithms.losses import GRPOLoss, LossConfig
    from asyncrl.recipes import default_optimizer

    return LocalBackend(model, default_optimizer(model, cfg), GRPOLoss(LossConfig()), cfg)


def warm(args: argparse.Namespace, backend: Any, vocab: int) -> None:
    """Before timing: the compile warm-up, then ``--warm-batches`` full batches, ending at full size so the
    allocator is too, with widths seen before, as in a long run's steady state."""
    common.warm_up_learner(backend, batch(args, vocab, 0))
    for i in range(args.warm_batches):
        backend.train_step(batch(args, vocab, 1000 + i), 0)


def measure(args: argparse.Namespace, base: Any, variant: dict[str, Any]) -> dict[str, Any]:
    cfg = dataclasses.replace(learner_config(args, variant), score_from_logits=variant["scoring"] == "logits")
    return _measure(args, base, cfg) | {"scoring": variant["scoring"]}


def _measure(args: argparse.Namespace, base: Any, cfg: Any) -> dict[str, Any]:
    import torch
    from torch._dynamo.utils import counters

    from asyncrl.actors.training import forward_tokens

    packing, grad_ckpt = cfg.packing, cfg.gradient_checkpointing
    model = copy.deepcopy(base)
    backend = backend_for(model, cfg)
    vocab = model.config.vocab_size
    cuda = torch.cuda.is_available()
    counters.clear()
    t_warm = time.perf_counter()
    warm(args, backend, vocab)
    warm_s = time.perf_counter() - t_warm
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    batches = [batch(args, vocab, s + 1) for s in range(args.steps)]
    t0 = time.perf_counter()
    for step, groups in enumerate(batches):
        backend.train_step(groups, step + 1)
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    tokens = sum(forward_tokens(g) for groups in batches for g in groups)
    params = sum(p.numel() for p in model.parameters())
    out = {"packing": packing, "grad_ckpt": grad_ckpt, "varlen": cfg.varlen_attention,
           "compiled": cfg.compiled, "compiled_layers": cfg.compile_layers,
           "micro_batch_tokens": cfg.micro_batch_tokens, "graph_breaks": sum(counters["graph_break"].values()),
           "compiled_graphs": counters["stats"]["unique_graphs"],
           "warm_up_s": warm_s, "steps": args.steps, "step_s": wall / args.steps,
           "tokens_per_step": tokens / args.steps, "tokens_per_s": tokens / wall,
           "computed_tokens_per_step": sum(computed_tokens(g, cfg) for g in batches) / args.steps,
           "params": params, "mfu": 6 * params * (tokens / wall) / args.peak_flops}
    if cuda:
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    del backend, model
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    common.set_env()
    result = common.Result("learner_speed", args, module="bench.gpu.learner_speed")
    base = build(args)
    runs = []
    for variant in variants(args):
        r = measure(args, base, variant)
        runs.append(r)
        waste = r["computed_tokens_per_step"] / r["tokens_per_step"]
        print(f"{variant}: {r['tokens_per_s']:.0f} tokens/s, MFU {100 * r['mfu']:.3f}%, "
              f"computed/real tokens {waste:.2f}, warm-up {r['warm_up_s']:.1f} s", flush=True)
    result.write({"shape": args.shape, "runs": runs}, suffix=suffix(args))


def suffix(args: argparse.Namespace) -> str:
    """The result file's name after the device: which variants ran."""
    if args.ladder:
        return "_ladder"
    out = "_all" if args.all else "_" + ("packed" if args.packing else "padded") + ("_ckpt" * args.grad_ckpt)
    out += "_varlen" * (args.varlen and args.packing) + "_compiled" * args.compile + "_layers" * args.compile_layers
    return out + ("_scoring" if args.scoring == "both" else "")


if __name__ == "__main__":
    main()
