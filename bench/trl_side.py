"""TRL's side of ``bench/vs_trl.py``; runs in TRL's own venv (not the project's), as a subprocess.

    .cache/trl-venv/bin/python bench/trl_side.py SPEC.json RESULT.json

SPEC (written by vs_trl.py): model_dir, out_dir, prompts, answers, n, batch_groups, max_tokens, steps, lr, seed,
fixed_length (sample exactly max_tokens tokens: ``min_new_tokens``), reward ("exact" or "prefix"), use_vllm.
Trains with ``GRPOTrainer`` as a user would (transformers generation unless use_vllm), saves the model into
out_dir and writes RESULT: init_s, train_s, gen_s (time inside ``model.generate``), samples, rewards per step,
or ``error`` if TRL failed. Self-contained: imports neither asyncrl nor the project's venv.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path


def reward_fn(kind: str):
    def exact(completions, answer, **_):
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

    def prefix(completions, answer, **_):
        return [1.0 if c.strip().startswith(a) else 0.0 for c, a in zip(completions, answer)]

    return {"exact": exact, "prefix": prefix}[kind]


def main(spec_path: str, out_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    result: dict = {"trl_side": True}
    t0 = time.perf_counter()
    try:
        import torch
        import trl
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from trl import GRPOConfig, GRPOTrainer

        result["versions"] = {"trl": trl.__version__, "torch": torch.__version__,
                              "transformers": __import__("transformers").__version__}
        if spec.get("threads"):
            torch.set_num_threads(spec["threads"])
        result["torch_threads"] = torch.get_num_threads()
        tok = AutoTokenizer.from_pretrained(spec["model_dir"])
        model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
        gen_s = [0.0]
        generate = model.generate

        def timed_generate(*args, **kwargs):
            t = time.perf_counter()
            try:
                return generate(*args, **kwargs)
            finally:
                gen_s[0] += time.perf_counter() - t

        model.generate = timed_generate
        data = Dataset.from_dict({"prompt": spec["prompts"], "answer": spec["answers"]})
        per_step = spec["n"] * spec["batch_groups"]
        extra = {}
        if spec["use_vllm"]:
            extra = {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.1,
                     "vllm_max_model_length": 256}
        config = GRPOConfig(
            output_dir=str(Path(spec["out_dir"]) / "trainer"), per_device_train_batch_size=per_step,
            gradient_accumulation_steps=1, num_generations=spec["n"], max_completion_length=spec["max_tokens"],
            max_steps=spec["steps"], learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0,
            weight_decay=0.0, max_grad_norm=1.0, beta=0.0, epsilon=0.2, epsilon_high=0.28, temperature=1.0,
            loss_type="dapo", scale_rewards="group", shuffle_dataset=False, logging_steps=1, save_strategy="no",
            report_to="none", use_cpu=not torch.cuda.is_available(), bf16=bool(spec.get("bf16")), seed=spec["seed"],
            dataloader_num_workers=0, disable_tqdm=True,
            # Fixed length: transformers calls it min_new_tokens, vLLM's SamplingParams min_tokens.
            generation_kwargs=({"min_tokens" if spec["use_vllm"] else "min_new_tokens": spec["max_tokens"]}
                               if spec["fixed_length"] else None),
            **extra,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=reward_fn(spec["reward"]), args=config, train_dataset=data,
                              processing_class=tok)
        result["init_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        trainer.train()
        result["train_s"] = time.perf_counter() - t1
        result["gen_s"] = gen_s[0]
        result["steps"] = trainer.state.global_step
        result["samples"] = trainer.state.global_step * per_step
        result["rewards"] = [h["reward"] for h in trainer.state.log_history if "reward" in h]
        result["completion_length"] = [h.get("completions/mean_length") for h in trainer.state.log_history
                                       if "reward" in h]
        model.generate = generate
        trainer.model.save_pretrained(str(Path(spec["out_dir"]) / "model"))
        tok.save_pretrained(str(Path(spec["out_dir"]) / "model"))
    except Exception as exc:  # reported, not raised: the parent records what failed
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-4000:]
    Path(out_path).write_text(json.dumps(result, indent=2))
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
