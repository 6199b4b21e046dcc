"""TRL's side of ``python -m bench.peers.vs_trl``: TRL's own venv, and the training run that happens inside it.

    .cache/trl-venv/bin/python -m bench.peers.trl_side SPEC.json RESULT.json      (from the repository root)

The parent (``bench.peers.vs_trl``, in the project's venv) creates the venv with ``setup_venv`` and runs this module
in TRL's interpreter as a subprocess with ``launch``. SPEC (written by vs_trl): model_dir, out_dir, prompts,
answers, n, batch_groups, max_tokens, steps, lr, seed, fixed_length (sample exactly max_tokens tokens:
``min_new_tokens``), reward ("exact", "prefix", or "countdown": ``bench.gpu.countdown.reward`` against the answers
as lengths), use_vllm, threads, bf16; optional (``bench.gpu.workload``): micro_batch (rollouts per forward /
backward; the rest of a step is gradient accumulation), vllm_max_model_length, vllm_gpu_memory_utilization,
vllm_sleep (``vllm_enable_sleep_mode``), save_model, lora (rank, alpha, target_modules: PEFT LoRA on a bf16
base). Trains with ``GRPOTrainer`` as a user would (transformers
generation unless use_vllm), saves the model into out_dir (unless save_model is false) and writes RESULT:
init_s, train_s, gen_s (time inside ``model.generate``), samples, rewards per step, completion lengths,
step_end_s (seconds from the start of training to the end of each step), or ``error`` if TRL failed; while
training, a snapshot of it after each step (``partial``: what a run cut short keeps).
Self-contained: only the standard library at module level; the run in TRL's venv imports neither asyncrl nor
anything from the project's venv.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TRL_VERSION = "1.16.0"

# ------------------------------------------------------------------------------- the parent's side (our venv)


def setup_venv(python: Path) -> None:
    """``python3 -m venv`` + pip install TRL with the project's torch and transformers versions."""
    import torch
    import transformers

    venv = python.parent.parent
    subprocess.run([sys.executable if not shutil.which("python3") else "python3", "-m", "venv", str(venv)],
                   check=True)
    torch_version = torch.__version__.split("+")[0]
    subprocess.run([str(python), "-m", "pip", "install", "-q", f"trl=={TRL_VERSION}", f"torch=={torch_version}",
                    f"transformers=={transformers.__version__}"], check=True)


def launch(python: Path | str, spec: dict[str, Any], work: Path, name: str, *, paths: list[str],
           timeout: float, module: str = "bench.peers.trl_side", extra_env: dict[str, str] | None = None,
           keep_partial: bool = False) -> dict[str, Any]:
    """Run ``module`` (this one, or ``bench.peers.trl_async_side``) in TRL's interpreter ``python`` on ``spec``, with
    ``paths`` as its PYTHONPATH and ``extra_env`` over this process's environment. Returns its RESULT (or an
    ``error`` and the tail of its stderr) with ``subprocess_wall_s`` added. A run past ``timeout`` is killed. A run
    that ends (timeout, crash) before its final write leaves only a snapshot: with ``keep_partial`` that is returned
    (its steps so far, ``partial``, a ``cut_short`` note), else an ``error``. Off by default: ``bench.peers.vs_trl``
    needs a whole run (its saved model, gen_s)."""
    work.mkdir(parents=True, exist_ok=True)
    spec_path, out_path = work / f"{name}_spec.json", work / f"{name}_result.json"
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_CPU_")} | {
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM":
        "false", "PYTHONWARNINGS": "ignore"}
    env.pop("PYTHONPATH", None)
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(extra_env or {})
    log_path = work / f"{name}_stderr.log"
    t0 = time.perf_counter()
    # Output to a file, so what it printed is on disk whatever happens. It stays in our process group, so whatever
    # kills that group (a command's watchdog) kills it too; at its own timeout kill_tree takes what it started.
    with log_path.open("w") as log:
        proc = subprocess.Popen([str(python), "-m", module, str(spec_path), str(out_path)], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            ended = f"TRL subprocess exited {proc.wait(timeout=timeout)}"
            missing = f"{ended} without a result"
        except subprocess.TimeoutExpired:
            ended = missing = f"TRL subprocess timed out after {timeout:.0f}s"
        finally:
            kill_tree(proc)
    wall = time.perf_counter() - t0
    stderr = log_path.read_text(errors="replace")[-3000:]
    res = json.loads(out_path.read_text()) if out_path.exists() else {}
    if res.get("partial") and keep_partial:  # the last snapshot (step_clock): the steps it ran are kept
        res["cut_short"] = ended
    elif not res or res.get("partial"):  # no result, or only a snapshot the caller does not take
        res = {"error": missing, "stderr_tail": stderr}
    res["subprocess_wall_s"] = wall
    return res


def kill_tree(proc: subprocess.Popen[Any]) -> None:
    """Kill ``proc`` and every process under it (compile workers, a colocated engine's processes), so nothing
    holding the GPU outlives it, and reap it. The descendants are listed first: once ``proc`` dies they would
    belong to init. Also on the way out of an exception (a cancelled wait)."""
    import psutil

    if proc.poll() is not None:  # it ended by itself, reaped: its pid may name another process by now
        return
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    for member in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()
    proc.kill()
    proc.wait()


# ------------------------------------------------------------------------------------ TRL's side (its venv)


def reward_fn(kind: str):
    def exact(completions, answer, **_):
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

    def prefix(completions, answer, **_):
        return [1.0 if c.strip().startswith(a) else 0.0 for c, a in zip(completions, answer)]

    def countdown(completions, answer, **_):
        from bench.gpu.countdown import reward

        return [reward(c, int(a)) for c, a in zip(completions, answer)]

    return {"exact": exact, "prefix": prefix, "countdown": countdown}[kind]


def grpo_config(spec: dict[str, Any], use_cpu: bool) -> Any:
    from trl import GRPOConfig

    extra = {}
    if spec["use_vllm"]:
        extra = {"use_vllm": True, "vllm_mode": "colocate",
                 "vllm_gpu_memory_utilization": spec.get("vllm_gpu_memory_utilization", 0.1),
                 "vllm_max_model_length": spec.get("vllm_max_model_length", 256),
                 "vllm_enable_sleep_mode": bool(spec.get("vllm_sleep", False))}
    rollouts = spec["n"] * spec["batch_groups"]
    micro = spec.get("micro_batch") or rollouts
    return GRPOConfig(
        output_dir=str(Path(spec["out_dir"]) / "trainer"), per_device_train_batch_size=micro,
        gradient_accumulation_steps=rollouts // micro, num_generations=spec["n"],
        max_completion_length=spec["max_tokens"],
        max_steps=spec["steps"], learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, beta=0.0, epsilon=0.2, epsilon_high=0.28, temperature=1.0,
        loss_type="dapo", scale_rewards="group", shuffle_dataset=False, logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=use_cpu, bf16=bool(spec.get("bf16")), seed=spec["seed"],
        dataloader_num_workers=0, disable_tqdm=True,
        # Fixed length: transformers calls it min_new_tokens, vLLM's SamplingParams min_tokens.
        generation_kwargs=({"min_tokens" if spec["use_vllm"] else "min_new_tokens": spec["max_tokens"]}
                           if spec["fixed_length"] else None),
        **extra,
    )


def train(spec: dict[str, Any], result: dict[str, Any], t0: float, out_path: str) -> None:
    """Train as ``spec`` says, filling ``result`` (and snapshots of it at ``out_path``: ``step_clock``)."""
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    result["versions"] = {"trl": trl.__version__, "torch": torch.__version__, "transformers": transformers.__version__}
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    result["torch_threads"] = torch.get_num_threads()
    tok = AutoTokenizer.from_pretrained(spec["model_dir"])
    lora = spec.get("lora")  # a LoRA run keeps its frozen base in bf16 (as ours does): PEFT's adapter is float32
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"],
                                                 dtype=torch.bfloat16 if lora and spec.get("bf16") else torch.float32)
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
    trainer = GRPOTrainer(model=model, reward_funcs=reward_fn(spec["reward"]),
                          args=grpo_config(spec, use_cpu=not torch.cuda.is_available()), train_dataset=data,
                          processing_class=tok, peft_config=peft_config(lora),
                          callbacks=[step_clock(result, out_path, spec["n"] * spec["batch_groups"])])
    result["init_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    result["train_start"] = t1
    trainer.train()
    result["train_s"] = time.perf_counter() - t1
    del result["train_start"]
    result["gen_s"] = gen_s[0]
    result.update(step_figures(trainer.state.log_history, trainer.state.global_step,
                               spec["n"] * spec["batch_groups"]))
    model.generate = generate
    if torch.cuda.is_available():
        result["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if spec.get("save_model", True):
        trainer.model.save_pretrained(str(Path(spec["out_dir"]) / "model"))
        tok.save_pretrained(str(Path(spec["out_dir"]) / "model"))


def peft_config(lora: dict[str, Any] | None) -> Any:
    """PEFT's adapter settings for a LoRA run (rank, alpha, target modules, as ours), else None."""
    if not lora:
        return None
    from peft import LoraConfig

    return LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], target_modules=list(lora["target_modules"]),
                      lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")


def step_clock(result: dict[str, Any], out_path: str, per_step: int) -> Any:
    """A callback that records, in ``result["step_end_s"]``, when each optimiser step ended (seconds since
    ``result["train_start"]``), and writes a snapshot at ``out_path`` after each step's log (``write_snapshot``): a
    run the parent kills at its timeout keeps its steps."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            result.setdefault("step_end_s", []).append(time.perf_counter() - result["train_start"])

        def on_log(self, args, state, control, logs=None, **kwargs):
            # A step's log (after its on_step_end, logging_steps=1), not the end-of-run summary.
            if logs and "reward" in logs and result.get("step_end_s"):
                write_snapshot(result, state.log_history, per_step, out_path)

    return StepClock()


def step_figures(history: list[dict[str, Any]], steps: int, per_step: int) -> dict[str, Any]:
    """What a run's ``steps`` say, with the per-step figures from TRL's log history: samples, rewards, mean
    completion lengths. The final RESULT and every snapshot take them from here."""
    logged = [h for h in history if "reward" in h]
    return {"steps": steps, "samples": steps * per_step, "rewards": [h["reward"] for h in logged],
            "completion_length": [h.get("completions/mean_length") for h in logged]}


def write_snapshot(result: dict[str, Any], history: list[dict[str, Any]], per_step: int, out_path: str) -> None:
    """``result`` so far as the final RESULT has it (steps, samples, rewards, completion lengths; ``train_s`` the
    last step's end), marked ``partial``. Written to a temporary file and renamed over ``out_path``, so a kill
    mid-write leaves the previous snapshot whole. The final write replaces it."""
    marks = result["step_end_s"]
    snap = {k: v for k, v in result.items() if k != "train_start"} | step_figures(history, len(marks), per_step) | {
        "train_s": marks[-1], "partial": True}
    tmp = Path(f"{out_path}.tmp")
    tmp.write_text(json.dumps(snap, indent=2))
    os.replace(tmp, out_path)


def run_reported(train_fn: Any, spec_path: str, out_path: str, result: dict[str, Any]) -> int:
    """Run ``train_fn(spec, result, t0, out_path)`` and write ``result`` (over any snapshot of it). A failure is
    reported, not raised: the parent records what failed. A long traceback keeps its first frames (what called)
    and its last (where it broke)."""
    spec = json.loads(Path(spec_path).read_text())
    t0 = time.perf_counter()
    try:
        train_fn(spec, result, t0, out_path)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        text = traceback.format_exc()
        result["traceback"] = text if len(text) <= 6000 else f"{text[:3000]}\n[...]\n{text[-3000:]}"
    Path(out_path).write_text(json.dumps(result, indent=2))
    return 0 if "error" not in result else 1


def main(spec_path: str, out_path: str) -> int:
    return run_reported(train, spec_path, out_path, {"trl_side": True})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
