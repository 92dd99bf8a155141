"""The prompt stream: a seeded, resumable order over task records (no prompt lost or repeated on resume)."""

from __future__ import annotations

import random
from typing import Any


class PromptStream:
    """Yields ``(prompt_index, task)``; each epoch is a fresh seeded permutation of the tasks.

    ``prompt_index`` counts prompts drawn since the start of training, so a checkpoint only needs the
    cursor (and the trajectories in flight) to continue exactly where it stopped.
    """

    def __init__(self, tasks: list[dict[str, Any]], seed: int):
        if not tasks:
            raise ValueError("the prompt stream needs at least one task")
        self.tasks = tasks
        self.seed = seed
        self.cursor = 0

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.tasks)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def task_at(self, prompt_index: int) -> dict[str, Any]:
        epoch, pos = divmod(prompt_index, len(self.tasks))
        return self.tasks[self._order(epoch)[pos]]

    def next(self) -> tuple[int, dict[str, Any]]:
        index = self.cursor
        self.cursor += 1
        return index, self.task_at(index)

    def state_dict(self) -> dict:
        return {"cursor": self.cursor, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"checkpoint was written with data seed {state['seed']}, config has {self.seed}")
        self.cursor = state["cursor"]
