"""A black-box agent, written only against the official ``openai`` client, trained by GRPO through asyncrl's
OpenAI-compatible endpoint.

    python -m asyncrl.examples.openai_agent                  # build, warm-start, RL (minutes on a 2-core CPU)
    python -m asyncrl.examples.openai_agent --steps 20 --out runs/agent_quick

The task is tool_use.py's: ``a*b=`` with two-digit operands, which a 2-layer character-level model cannot
multiply, but can solve with a calculator. Here the calculator is a function the agent offers through OpenAI
function calling (``tools=[calc]``): ``CalculatorAgent`` below is ordinary agent code (no asyncrl import) that
sends the problem, runs the calls the model makes, sends their results back as ``tool`` messages and returns the
final answer. asyncrl serves it an endpoint (``AgentEndpoint``) whose chat template lays the conversation out as
tool_use.py's episodes (``calculator.CHAT_TEMPLATE``), records every session token-exactly, and an
``AgentRunner`` turns 8 sessions per problem into a GRPO group, rewarded 1.0 for an exact final answer.

Held-out accuracy is measured by the same agent, greedily (``temperature=0``), through a second endpoint that
serves each request's own temperature (the training one imposes the policy's).

Writes into ``--out``: ``metrics.jsonl`` (per learner step; ``agent/*`` gauges included), ``openai_agent.png``,
``summary.json`` and ``base/`` (the warm-started model).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import secrets
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from asyncrl.examples import common, sft, tracking
from asyncrl.examples.calculator import CHAT_TEMPLATE, TOOL_TOKENS, CalcToolParser, multiplication_task

# -- the agent: only the openai client from here to the next section -------------------------------------------

CALC_TOOL = {"type": "function", "function": {
    "name": "calc", "description": "evaluate a*b, a+b or a-b on non-negative integers",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def calculate(expression: str) -> str:
    match = re.fullmatch(r"\s*(\d{1,6})\s*([*+-])\s*(\d{1,6})\s*", expression)
    if match is None:
        return "error"
    a, op, b = int(match[1]), match[2], int(match[3])
    return str(a * b if op == "*" else a + b if op == "+" else a - b)


class CalculatorAgent:
    """Asks, runs the calculator calls the model makes, returns its final answer ("" if it never gives one).

    One client for every episode (its connection pool with it): each episode only swaps the base URL, which is
    its session's (``with_options``). Creating a client per episode costs more than the episode on a small CPU."""

    def __init__(self, temperature: float | None = None, max_turns: int = 3, turn_tokens: int = 10) -> None:
        self.temperature, self.max_turns, self.turn_tokens = temperature, max_turns, turn_tokens
        self._client: Any = None

    async def __call__(self, base_url: str, api_key: str, task: str) -> str:
        from openai import AsyncOpenAI

        if self._client is None:
            self._client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60.0)
        client = self._client.with_options(base_url=base_url, api_key=api_key)
        messages: list[dict[str, Any]] = [{"role": "user", "content": task}]
        extra = {} if self.temperature is None else {"temperature": self.temperature}
        for _ in range(self.max_turns):
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALC_TOOL],
                                                         max_tokens=self.turn_tokens, **extra)
            message = reply.choices[0].message
            if not message.tool_calls:
                return message.content or ""
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                expression = json.loads(call.function.arguments).get("expression", "")
                messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(expression)})
        return ""

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()


# -- training ---------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/openai_agent"), help="run directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--held-out", type=int, default=200, help="held-out problems for evaluation")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--warm-steps", type=int, default=800, help="supervised warm-start steps (batch 64)")
    p.add_argument("--warm-tool-frac", type=float, default=0.25, help="share of warm-start examples using the tool")
    p.add_argument("--warm-lr", type=float, default=3e-3)
    p.add_argument("--steps", type=int, default=60, help="learner steps")
    p.add_argument("--n", type=int, default=8, help="episodes per problem (group size)")
    p.add_argument("--batch-groups", type=int, default=16, help="groups per learner step")
    p.add_argument("--turn-tokens", type=int, default=10, help="max_tokens the agent asks for per call")
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--temperature", type=float, default=1.0, help="the policy's sampling temperature")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--max-staleness", type=int, default=2)
    p.add_argument("--pause-mode", choices=("keep", "abort", "wait"), default="keep")
    p.add_argument("--eval-every", type=int, default=20, help="held-out eval every K steps (0 = off)")
    tracking.add_sink_args(p, tensorboard="off")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    from asyncrl.metrics import optional_sinks

    try:  # a sink asked for whose package is missing: refused now, not after the warm start
        optional_sinks(args.tensorboard, "on" if args.wandb else "off")
    except RuntimeError as exc:
        p.error(str(exc))
    return args


def pipeline_config(args: argparse.Namespace) -> Any:
    import asyncrl

    return asyncrl.PipelineConfig(
        progress=False,
        producer=asyncrl.ProducerConfig(sampling=asyncrl.SamplingConfig(n=args.n, max_tokens=args.turn_tokens,
                                                                        temperature=args.temperature),
                                        max_inflight_groups=args.batch_groups),
        queue=asyncrl.QueueConfig(capacity=common.queue_capacity(args.batch_groups, args.max_staleness),
                                  max_staleness=args.max_staleness),
        learner=asyncrl.LearnerConfig(batch_groups=args.batch_groups, lr=args.lr,
                                      micro_batch_rollouts=args.batch_groups * args.n,
                                      sync=asyncrl.SyncConfig(mode=args.pause_mode)),
    )


class AgentEval:
    """Greedy held-out accuracy and tool-call rate of the agent, one session per problem, through ``endpoint``
    (which must serve requests' own temperatures). A hook every ``every`` steps (``eval/*``), or by hand."""

    def __init__(self, endpoint: Any, agent: Any, task: common.Task, every: int, concurrency: int = 32) -> None:
        from asyncrl import Prompt
        from asyncrl.agents import AgentRunner

        self.runner = AgentRunner(endpoint, agent, reward_fn=lambda p, result: task.reward(result, p.answer))
        self.prompts = [Prompt(f"held-out-{i}", (), ex.prompt, ex.answer) for i, ex in enumerate(task.held_out)]
        self.every, self.concurrency, self.seconds = every, concurrency, 0.0

    async def evaluate(self) -> dict[str, float]:
        from asyncrl.errors import RolloutDropped

        t0, limit = time.perf_counter(), asyncio.Semaphore(self.concurrency)

        async def one(prompt: Any) -> tuple[float, bool]:
            async with limit:
                try:
                    group = await self.runner.build_group(f"eval-{prompt.prompt_id}", prompt, n=1)
                except RolloutDropped:
                    return 0.0, False  # an episode that cannot be played scores nothing; counted below
            rollout = group.rollouts[0]
            return rollout.reward, sum(rollout.sample.loss_mask[i] > rollout.sample.loss_mask[i - 1]
                                       for i in range(1, len(rollout.sample.loss_mask))) > 0
        results = await asyncio.gather(*(one(p) for p in self.prompts))
        self.seconds += time.perf_counter() - t0
        return {"accuracy": sum(r for r, _ in results) / len(results),
                "tool_rate": sum(t for _, t in results) / len(results)}

    async def __call__(self, step: int, metrics: dict[str, float]) -> None:
        if self.every and step % self.every == 0:
            out = await self.evaluate()
            metrics.update({"eval/accuracy": out["accuracy"], "eval/tool_rate": out["tool_rate"]})


async def main(args: argparse.Namespace, task: common.Task, model_dir: Path) -> dict[str, Any]:
    """Engine and two endpoints up -> evaluation before -> GRPO through the endpoint -> evaluation after."""
    from transformers import AutoTokenizer

    from asyncrl.agents import AgentEndpoint, ChatRenderer, EndpointConfig
    from asyncrl.engines.vllm_local import VLLMEngine, VLLMEngineConfig

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    renderer = ChatRenderer(tok, CHAT_TEMPLATE, CalcToolParser())
    token = secrets.token_urlsafe(16)
    monitor = tracking.open_monitor(args, {k: str(v) for k, v in vars(args).items()})
    engine = await VLLMEngine.start(VLLMEngineConfig(
        model=str(model_dir), dtype="float32", max_model_len=16 * (args.max_turns + 2), seed=args.seed,
        max_num_seqs=max(64, args.n * args.batch_groups), kv_cache_gib=args.kv_cache_gib))
    try:
        training = EndpointConfig(token=token, temperature=args.temperature)  # requests sample as the learner scores
        async with AgentEndpoint(engine, renderer, training) as train, \
                AgentEndpoint(engine, renderer, EndpointConfig(token=token)) as held_out:
            agent = CalculatorAgent(max_turns=args.max_turns, turn_tokens=args.turn_tokens)
            greedy = CalculatorAgent(temperature=0.0, max_turns=args.max_turns, turn_tokens=args.turn_tokens)
            try:
                evals = AgentEval(held_out, greedy, task, args.eval_every)
                result = await _train(args, engine, tok, task, train, agent, evals, monitor)
            finally:
                await agent.close()
                await greedy.close()
    finally:
        monitor.close()
        await engine.close()
    return result


async def _train(args: argparse.Namespace, engine: Any, tok: Any, task: common.Task, endpoint: Any, agent: Any,
                 evals: AgentEval, monitor: Any) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl import Prompt, PromptSource
    from asyncrl.agents import AgentRunner
    from asyncrl.recipes import grpo_pipeline

    config = pipeline_config(args)
    runner = AgentRunner(endpoint, agent, reward_fn=lambda p, result: task.reward(result, p.answer))
    prompts = PromptSource(Prompt(f"train-{i}", (), ex.prompt, ex.answer)
                           for i, ex in common.endless(task.train, args.seed))
    policy = AutoModelForCausalLM.from_pretrained(str(endpoint.renderer.tokenizer.name_or_path), dtype=torch.float32)
    pipeline = grpo_pipeline(engine, policy, prompts, runner, config, pad_id=tok.pad_token_id, monitor=monitor,
                             close_engine=False)
    before = await evals.evaluate()
    print(f"before RL: held-out greedy accuracy {before['accuracy']:.1%}, tool-call rate {before['tool_rate']:.1%}",
          flush=True)
    progress = tracking.ProgressHook(args.steps, desc="GRPO (openai agent)", disable=args.no_progress)
    try:
        pipeline.learner.hooks += [evals, progress]
        stats = await pipeline.run(args.steps)
    finally:
        progress.close()
    after = await evals.evaluate()
    return {"before": before, "after": after, "eval_s": evals.seconds, "steps": stats.steps, "wall_s": stats.wall_s,
            "samples_trained": stats.samples_trained, "dropped": stats.dropped, "agent": runner.metrics()}


def prepare_model(args: argparse.Namespace, task: common.Task) -> tuple[Path, dict[str, Any]]:
    """tool_use.py's model and warm start (``sft.tool_warm_start``; the chat template lays conversations out as
    its episodes)."""
    base = args.out / "base"
    shutil.rmtree(base, ignore_errors=True)
    sft.build_char_model(base, task, args.hidden, args.layers, args.seed, added_tokens=TOOL_TOKENS)
    info = sft.tool_warm_start(base, task, args.warm_steps, args.warm_tool_frac, args.warm_lr, args.seed,
                               progress=not args.no_progress)
    print(f"warm start: {info['steps']} SFT steps in {info['seconds']:.0f}s (loss {info['final_loss']:.3f})",
          flush=True)
    return base, info


def report(args: argparse.Namespace, result: dict[str, Any], warm: dict[str, Any], total_s: float) -> None:
    rows = tracking.read_jsonl(args.out / "metrics.jsonl")
    summary = {**result, "warm_start": warm, "total_s": total_s, "args": common.jsonable(vars(args))}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    rows = [{**r, "episode/tool_call_rate": r.get("agent/calls_per_episode", 1.0) - 1.0} for r in rows]
    png = tracking.plot_tool_run(rows, args.out / "openai_agent.png", result["before"], result["after"],
                                 result["steps"])
    tracking.print_tool_result(args.out, result, png, total_s)


def cli(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    common.start_cli(args.verbose, args.torch_threads)
    import asyncrl

    t0 = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    task = multiplication_task(n_held_out=args.held_out, seed=args.seed)
    model_dir, warm = prepare_model(args, task)
    result = asyncrl.run(main(args, task, model_dir))
    report(args, result, warm, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(common.run_cli(cli))  # Ctrl-C exits 130, SIGTERM 143, as the asyncrl-* commands do
