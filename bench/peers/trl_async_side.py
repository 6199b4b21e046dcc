"""TRL's asynchronous GRPO (``trl.experimental.async_grpo.AsyncGRPOTrainer``) against a ``vllm serve`` on another
GPU: the two-GPU TRL side of ``python -m bench.gpu.workload --layout 2gpu``.

    python -m bench.peers.trl_async_side SPEC.json RESULT.json      (TRL's interpreter, from the repository root)

The parent (``launch``, in the project's environment) starts the OpenAI server on ``server_gpu``
(``vllm.entrypoints.openai.api_server`` with ``VLLM_SERVER_DEV_MODE=1`` and ``--weight-transfer-config
{"backend": "nccl"}``, as TRL's documentation asks; started by ``asyncrl.engines.vllm_remote.process``, which
also loads asyncrl's worker extension: extra RPC methods, nothing on the generation path), waits for
/health, then runs this module in TRL's interpreter on ``trainer_gpu``. SPEC (from ``bench.gpu.workload``):
model_dir, out_dir, prompts, answers (countdown lengths), n, batch_groups, max_tokens, steps, lr, seed,
max_staleness, server_url. RESULT: init_s, train_s, samples, step_end_s, completion lengths, rewards, or
``error``.

Settings matched to ours: float32 weights under bf16 autocast (TRL's defaults for this trainer), no gradient
checkpointing (its default is on; ours has none), ``per_device_train_batch_size=n`` with ``batch_groups``
accumulation steps and ``token_budget=0`` (a fixed number of samples per optimiser step, as ours),
``max_staleness`` as ours, a weight sync every step, clip 0.2/0.28, constant learning rate.

Its trainer packs samples into prefix trees and runs attention through ``kernels-community/flash-attn3``, a
kernel ``kernels.get_kernel`` downloads from the Hugging Face Hub at run time; the GPU host reaches no network,
so ``bench/gpu/trl_kernels`` stands in for the ``kernels`` package: the same varlen call served by PyTorch's
``torch.nn.attention.varlen`` (FlashAttention-2 kernels inside torch) instead of FlashAttention-3. Recorded in
the result as ``attention``; it is a difference in TRL's disfavour on the attention share of its step.

Self-contained at module level (standard library): the TRL run imports neither asyncrl nor the project's venv.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SHIM = ROOT / "bench" / "gpu" / "trl_kernels"


async def launch(python: str, spec: dict[str, Any], work: Path, name: str, *, paths: list[str], timeout: float,
                 server_gpu: str, trainer_gpu: str, server_args: list[str]) -> dict[str, Any]:
    """Start the server on ``server_gpu``, run the trainer (``bench.peers.trl_side.launch``) on ``trainer_gpu``, stop
    the server. Returns the trainer's RESULT with ``server_start_s`` added."""
    import asyncio

    from asyncrl.engines.vllm_remote.process import free_port, start_vllm_server
    from bench.peers import trl_side

    port, log_path = free_port(), work / f"{name}_server.log"
    work.mkdir(parents=True, exist_ok=True)
    log_path.unlink(missing_ok=True)
    env = {"CUDA_VISIBLE_DEVICES": server_gpu, "VLLM_SERVER_DEV_MODE": "1"}
    args = ["--weight-transfer-config", json.dumps({"backend": "nccl"}), *server_args]
    t0 = time.perf_counter()
    try:
        async with start_vllm_server(spec["model_dir"], port, extra_args=args, env=env, startup_timeout_s=timeout,
                                     log_path=log_path) as server:
            started = time.perf_counter() - t0
            spec = {**spec, "server_url": server.base_url}
            res = await asyncio.to_thread(trl_side.launch, python, spec, work, name, paths=[str(SHIM), *paths],
                                          timeout=timeout, module="bench.peers.trl_async_side",
                                          extra_env={"CUDA_VISIBLE_DEVICES": trainer_gpu}, keep_partial=True)
            res["server_start_s"] = started
    except Exception as exc:  # the server failed to start or died: reported, not raised
        res = {"error": f"vLLM server: {type(exc).__name__}: {exc}"}
    if "error" in res and log_path.exists():
        res["server_log_tail"] = log_path.read_text(errors="replace")[-3000:]
    return res


# ------------------------------------------------------------------------------------ TRL's side (its env)


def countdown_reward(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
    """Module level: the trainer scores in a spawned process, so the function must pickle by name."""
    from bench.gpu.countdown import reward

    texts = [c if isinstance(c, str) else (c[-1]["content"] if c else "") for c in completions]
    return [reward(t, int(a)) for t, a in zip(texts, answer)]


def config(spec: dict[str, Any]) -> Any:
    import torch
    from trl.experimental.async_grpo import AsyncGRPOConfig

    return AsyncGRPOConfig(
        output_dir=str(Path(spec["out_dir"]) / "trainer"), per_device_train_batch_size=spec["n"],
        gradient_accumulation_steps=spec["batch_groups"], num_generations=spec["n"],
        max_completion_length=spec["max_tokens"], max_steps=spec["steps"], learning_rate=spec["lr"],
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, epsilon=0.2,
        epsilon_high=0.28, temperature=1.0, max_staleness=spec["max_staleness"], weight_sync_steps=1,
        token_budget=0, gradient_checkpointing=False, bf16=bool(spec.get("bf16", True)), dtype="float32",
        use_cpu=not torch.cuda.is_available(), logging_steps=1,
        save_strategy="no", report_to="none", seed=spec["seed"], vllm_server_base_url=spec["server_url"],
        dataloader_num_workers=0, disable_tqdm=True)


def train(spec: dict[str, Any], result: dict[str, Any], t0: float, out_path: str) -> None:
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    from bench.peers.trl_side import step_clock, step_figures

    import kernels  # the stand-in (see the module docstring)

    result["versions"] = {"trl": trl.__version__, "torch": torch.__version__, "transformers": transformers.__version__}
    result["attention"] = getattr(kernels, "DESCRIPTION", "kernels package")
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in spec["prompts"]],
                              "answer": spec["answers"]})
    trainer = AsyncGRPOTrainer(model=spec["model_dir"], reward_funcs=countdown_reward, args=config(spec),
                               train_dataset=data,
                               callbacks=[step_clock(result, out_path, spec["n"] * spec["batch_groups"])])
    result["init_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    result["train_start"] = t1
    trainer.train()
    result["train_s"] = time.perf_counter() - t1
    del result["train_start"]
    history = trainer.state.log_history
    result.update(step_figures(history, trainer.state.global_step, spec["n"] * spec["batch_groups"]))
    result["log_keys"] = sorted({k for h in history for k in h})
    result["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30


def main(spec_path: str, out_path: str) -> int:
    from bench.peers.trl_side import run_reported

    return run_reported(train, spec_path, out_path, {"trl_side": "async"})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
