"""Helpers shared by the multi-turn episode tests (not fixtures): a prompt and a scripted environment."""

from __future__ import annotations

from asyncrl import Prompt
from asyncrl.episodes import StepResult
from asyncrl.types import Sample

PROMPT = Prompt("p0", (1, 2, 3), answer=7)
ENV_IDS = (97, 98)


class ScriptedEnv:
    """Appends ``ENV_IDS`` after every turn, rewards 0.5 per step, done after ``turns`` steps; records calls."""

    def __init__(self, turns: int = 3, ids: tuple[int, ...] = ENV_IDS) -> None:
        self.turns, self.ids = turns, ids
        self.seen: list[tuple[int, ...]] = []
        self.closed = 0

    async def step(self, turn: Sample) -> StepResult:
        self.seen.append(turn.token_ids)
        return StepResult(self.ids, reward=0.5, done=len(self.seen) == self.turns, text="|")

    async def close(self) -> None:
        self.closed += 1
