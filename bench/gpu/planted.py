"""A countdown policy written into a model's weights instead of trained there: the warm start of shapes too large
to warm-start by supervised training inside one device call (7-8B: a full supervised warm start needs weights,
gradients and AdamW state, 16 bytes a parameter, and minutes of GPU time a 10-minute call does not have).

The task (``bench.gpu.countdown``) is a successor table: number K is followed by K-1, and 0 by end-of-sequence.
The table is planted in the embedding and the output head, and every residual branch starts near zero (the last
projection of each attention and MLP block, ``o_proj`` and ``down_proj``, drawn at ``BRANCH_STD``: near zero
rather than zero, so that FP8's per-tensor scales stay finite), so the residual stream carries each token's
embedding to the head almost unchanged:

- every embedding row is standard normal except coordinate 0, a constant 1 in every row: after the final
  RMSNorm that coordinate is close to 1 for every token, a bias the head can read;
- the head's row for K-1 is ``beta`` times the unit embedding of K (and end-of-sequence's, that of 0), so at K
  the right token scores ``beta * sqrt(hidden)`` and any other task row about ``beta`` times a standard normal;
- rows of ids beyond the tokenizer read the bias coordinate at ``-OUTSIDE``: never sampled, never decoded;
- ``beta`` is set so that sampling at temperature 1 picks a wrong token with probability about ``token_error``.

So the policy counts down from its first step, its answer lengths are the task's own long tail, and sampling
errors leave GRPO a signal to learn (the reward is the share of the countdown right from its start). The other
weights are random (std 0.02) and cost what a trained model's cost: a step computes the same FLOPs either way.
Building costs no GPU training: the tensors are drawn on the device and written as safetensors shards.

    python -m bench.gpu.planted OUT --shape qwen2.5-7b
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from bench.gpu import countdown

BRANCH_STD = 1e-5  # o_proj / down_proj: the residual branches start close to the identity
WEIGHT_STD = 0.02  # every other projection, as transformers initialises them
OUTSIDE = 30.0  # logit penalty of ids beyond the tokenizer
SHARD_BYTES = 4 << 30
EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"  # the planted tensors


def head_scale(hidden: int, known: int, tasks: int, token_error: float) -> float:
    """``beta``: the right token's logit ``beta * sqrt(hidden)`` leaves it probability ``1 - token_error`` under
    sampling at temperature 1, against ``known - tasks`` tokens scoring 0 and ``tasks`` head rows scoring
    ``beta`` times a standard normal (``exp(beta^2 / 2)`` each, on average; solved by fixed-point iteration)."""
    if not 0 < token_error < 1:
        raise ValueError(f"token_error must lie in (0, 1), got {token_error}")
    beta = 0.0
    for _ in range(50):
        others = known - tasks + tasks * math.exp(beta * beta / 2)
        beta = math.log(others * (1 - token_error) / token_error) / math.sqrt(hidden)
    return beta


def task_ids(tok: Any) -> list[int]:
    """Token ids of the numbers 0 .. ``countdown.WORDS`` as the answer writes them (after a space)."""
    ids = [tok(" " + countdown.number(k), add_special_tokens=False).input_ids for k in range(countdown.WORDS + 1)]
    if any(len(i) != 1 for i in ids):
        raise RuntimeError("the tokenizer splits some numbers: a planted table needs one token per number")
    return [i[0] for i in ids]


def model_config(shape: str, tok: Any) -> Any:
    """The transformers config of ``shape`` (``countdown.SHAPES``), with the tokenizer's special ids."""
    import transformers

    spec = dict(countdown.SHAPES[shape])
    arch = spec.pop("arch", "qwen2")
    cls = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig}[arch]
    return cls(**spec, max_position_embeddings=8192, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id, torch_dtype="bfloat16")


def tensor_shapes(shape: str) -> dict[str, tuple[int, ...]]:
    """Every tensor of ``shape``'s checkpoint (``countdown.SHAPES``, untied head), by transformers' names, in
    the order ``plant`` draws them."""
    s = countdown.SHAPES[shape]
    d, inter, vocab = s["hidden_size"], s["intermediate_size"], s["vocab_size"]
    head = d // s["num_attention_heads"]
    q, kv = s["num_attention_heads"] * head, s["num_key_value_heads"] * head
    layer = {"input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
             "self_attn.q_proj.weight": (q, d), "self_attn.k_proj.weight": (kv, d),
             "self_attn.v_proj.weight": (kv, d), "self_attn.o_proj.weight": (d, q), "mlp.gate_proj.weight": (inter, d),
             "mlp.up_proj.weight": (inter, d), "mlp.down_proj.weight": (d, inter)}
    if s.get("arch", "qwen2") == "qwen2":  # Qwen2 has biases on q, k and v
        layer |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
    out = {EMBEDDING: (vocab, d)}
    for i in range(s["num_hidden_layers"]):
        out |= {f"model.layers.{i}.{name}": dims for name, dims in layer.items()}
    return out | {"model.norm.weight": (d,), HEAD: (vocab, d)}


def param_count(shape: str) -> int:
    return sum(math.prod(dims) for dims in tensor_shapes(shape).values())


def layer_tensor(name: str, shape: tuple[int, ...], gen: Any, device: str) -> Any:
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16, device=device)
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=torch.bfloat16, device=device)
    std = BRANCH_STD if name.split(".")[-2] in ("o_proj", "down_proj") else WEIGHT_STD
    return (torch.randn(shape, generator=gen, device=device) * std).to(torch.bfloat16)


def embedding_and_head(cfg: Any, tok: Any, gen: Any, device: str, token_error: float) -> tuple[Any, Any, float]:
    """The embedding (bias coordinate set) and the planted head, and the head's ``beta``."""
    import torch

    vocab, d = cfg.vocab_size, cfg.hidden_size
    known = len(tok)
    embed = torch.randn((vocab, d), generator=gen, device=device)
    embed[:, 0] = 1.0
    ids = task_ids(tok)
    beta = head_scale(d, known, len(ids), token_error)
    head = torch.zeros((vocab, d), device=device)
    unit = embed[ids] / embed[ids].norm(dim=1, keepdim=True)
    head[ids[:-1]] = beta * unit[1:]  # at K, the row of K-1 points along K's embedding
    head[tok.eos_token_id] = beta * unit[0]  # at 0, end-of-sequence
    head[known:, 0] = -OUTSIDE
    return embed.to(torch.bfloat16), head.to(torch.bfloat16), beta


def plant(out: Path, shape: str, *, token_error: float = 1e-3, seed: int = 0, device: str | None = None
          ) -> dict[str, Any]:
    """Tokenizer, config and planted bf16 weights of ``shape`` in ``out`` (``shape``'s head must be untied: a tied
    head cannot hold a successor table). Returns what it built and how long it took."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    if not countdown.is_planted(shape):
        raise ValueError(f"{shape} ties its head to its embedding: a planted table needs them apart")
    t0 = time.perf_counter()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    out.mkdir(parents=True, exist_ok=True)
    countdown.build_tokenizer(out)
    tok = AutoTokenizer.from_pretrained(str(out))
    cfg = model_config(shape, tok)
    gen = torch.Generator(device=device).manual_seed(seed)
    embed, head, beta = embedding_and_head(cfg, tok, gen, device, token_error)
    planted = {EMBEDDING: embed, HEAD: head}
    tensors = {name: planted[name] if name in planted else layer_tensor(name, dims, gen, device)
               for name, dims in tensor_shapes(shape).items()}
    params = sum(t.numel() for t in tensors.values())
    write_shards(out, tensors, save_file)
    cfg.save_pretrained(str(out))
    countdown.check_tokenizer(out)
    return {"shape": shape, "params": params, "token_error": token_error, "beta": beta, "seed": seed,
            "seconds": time.perf_counter() - t0, "device": device}


def write_shards(out: Path, tensors: dict[str, Any], save_file: Any) -> None:
    """Safetensors shards of at most ``SHARD_BYTES`` and their index, as transformers and vLLM read them."""
    shards: list[dict[str, Any]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, shard in zip(files, shards):
        save_file({k: v.contiguous().cpu() for k, v in shard.items()}, str(out / file), metadata={"format": "pt"})
        weight_map |= {k: file for k in shard}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--shape", choices=[s for s in countdown.SHAPES if countdown.is_planted(s)],
                   default="qwen2.5-7b")
    p.add_argument("--token-error", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    info = plant(args.out, args.shape, token_error=args.token_error, seed=args.seed)
    print("PLANTED " + json.dumps(info), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
