"""Nash-MD's opponent: sampling from the geometric mixture of the policy and the reference, token by token.

The mixture's next-token distribution is ``softmax(((1 - m) * z_policy + m * z_ref) / T)`` over the two models'
logits ``z``, with ``m = mixture_coef``: it needs both models' logits at every step of the same sequence. vLLM
samples from one model's logits and cannot mix two, so this sampler runs in torch, here: two forward passes per
token with a KV cache each, in a thread of its own (never on the event loop). That is the cost Nash-MD pays
over XPO, and ``JudgeCounters.opponent_s`` reports it. It suits small policies; a large one would want the
mixture inside an engine, which vLLM does not offer.

The sampler holds its own copy of the policy, refreshed from the learner's model after every learner step
(``follow``: a learner hook; the learner's thread is idle between steps), so the mixture tracks the policy as
it trains. Its samples carry the learner step they were drawn at as their version.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from asyncrl.config import SamplingConfig
from asyncrl.engines.protocols import BehaviourPrecision, PromptRejected
from asyncrl.types import FinishReason, Sample, VersionSpan

__all__ = ["MixtureSampler"]


class MixtureSampler:
    """A ``Sampler`` of the geometric mixture of ``policy`` (copied) and ``reference`` (shared, frozen)."""

    def __init__(self, policy: torch.nn.Module, reference: torch.nn.Module, tokenizer: Any, *,
                 mixture_coef: float = 0.5, max_model_len: int = 2048, eos_token_id: int | None = None,
                 seed: int = 0, name: str = "mixture") -> None:
        if not 0.0 <= mixture_coef <= 1.0:
            raise ValueError(f"mixture_coef must be in [0, 1], got {mixture_coef!r}")
        self.name = name
        self.mixture_coef = mixture_coef
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        self._policy = copy.deepcopy(policy).eval().requires_grad_(False)
        self._reference = reference.eval()
        self._max_model_len = max_model_len
        self._version = 0
        self._lock = threading.Lock()  # the policy copy: refreshed on the loop, read by the sampling thread
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="asyncrl-mixture")
        self._generator = torch.Generator().manual_seed(seed)

    @property
    def version(self) -> int:
        return self._version

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def vocab_size(self) -> int:
        return int(self._policy.config.vocab_size)

    @property
    def behaviour_precision(self) -> BehaviourPrecision:
        return BehaviourPrecision(str(next(self._policy.parameters()).dtype).removeprefix("torch."))

    def refresh(self, policy: torch.nn.Module, version: int) -> None:
        """Copy ``policy``'s weights into the mixture's copy (call while nothing trains it)."""
        with self._lock, torch.no_grad():
            for mine, theirs in zip(self._policy.state_dict().values(), policy.state_dict().values()):
                mine.copy_(theirs)
            self._version = version

    def follow(self, learner: Any) -> Callable[[int, dict[str, float]], None]:
        """A learner hook refreshing the copy from ``learner.model`` after every step."""
        def hook(step: int, metrics: dict[str, float]) -> None:
            self.refresh(learner.model, step)

        return hook

    async def generate(self, prompt_ids: tuple[int, ...], params: SamplingConfig, request_id: str,
                       n: int | None = None) -> list[Sample]:
        if not prompt_ids or len(prompt_ids) >= self._max_model_len:
            raise PromptRejected(f"{self.name}: prompt of {len(prompt_ids)} tokens for a context of "
                                 f"{self._max_model_len}", too_long=bool(prompt_ids))
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, self._sample, prompt_ids, params, n or params.n)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    def _sample(self, prompt_ids: tuple[int, ...], params: SamplingConfig, n: int) -> list[Sample]:
        budget = min(params.max_tokens, self._max_model_len - len(prompt_ids))
        stops = {self.eos_token_id, *params.stop_token_ids} - {None}
        with self._lock, torch.no_grad():
            version = self._version
            ids = torch.tensor([prompt_ids] * n)
            caches: list[Any] = [None, None]
            inputs = ids
            tokens, logps = torch.zeros(n, 0, dtype=torch.long), torch.zeros(n, 0)
            done = torch.zeros(n, dtype=torch.bool)
            for _ in range(budget):
                logits = []
                for k, model in enumerate((self._policy, self._reference)):
                    out = model(input_ids=inputs, past_key_values=caches[k], use_cache=True)
                    caches[k] = out.past_key_values
                    logits.append(out.logits[:, -1].float())
                mixed = ((1 - self.mixture_coef) * logits[0] + self.mixture_coef * logits[1]) / params.temperature
                logp = torch.log_softmax(mixed, dim=-1)
                nxt = torch.multinomial(logp.exp(), 1, generator=self._generator)
                tokens = torch.cat([tokens, nxt], dim=1)
                logps = torch.cat([logps, logp.gather(1, nxt)], dim=1)
                if not params.ignore_eos:
                    done |= torch.tensor([int(t) in stops for t in nxt[:, 0]])
                if bool(done.all()):
                    break
                inputs = nxt
        return [self._as_sample(tokens[i].tolist(), logps[i].tolist(), stops, params, version) for i in range(n)]

    def _as_sample(self, ids: list[int], logps: list[float], stops: set[int], params: SamplingConfig,
                   version: int) -> Sample:
        end = next((i + 1 for i, t in enumerate(ids) if t in stops), None) if not params.ignore_eos else None
        finish = FinishReason.STOP if end is not None else FinishReason.LENGTH
        ids, logps = (ids[:end], logps[:end]) if end is not None else (ids, logps)
        return Sample(token_ids=tuple(ids), logprobs=tuple(logps), finish_reason=finish,
                      version_spans=(VersionSpan(version, 0, len(ids)),),
                      text=self.tokenizer.decode(ids, skip_special_tokens=True))
