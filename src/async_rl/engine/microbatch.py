"""Micro-batches by token budget (``trainer.max_tokens_per_micro_batch``), the way verl's dynamic batch
size bounds activation memory, plus an optional row cap (``trainer.micro_batch_size``).

A micro-batch of ``n`` rows costs ``n x (max prompt width + max response width)`` tokens once the
all-padding columns are dropped (:func:`trim_bounds`, :func:`padded_tokens`). :func:`pack_rows` packs rows
**in order** within the budget, so outputs concatenate back into batch order and no trajectory is split;
:class:`MicroBatchPlan` also makes every data-parallel rank run the same number of micro-batches
(:meth:`MicroBatchPlan.split`). Gradient accumulation is exact: every micro-batch divides by the step's
:class:`~async_rl.engine.base.GlobalDenominator`.

Details: docs/engine.md (§7 Precision and memory-bounded updates, "Micro-batches by token budget").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from async_rl.engine import dist


def _first_true(mask: torch.Tensor) -> torch.Tensor:
    """(bs,) index of the first nonzero column of each row of a (bs, W) mask (W if none)."""
    width = mask.shape[1]
    columns = torch.arange(width, device=mask.device).expand_as(mask)
    return torch.where(mask > 0, columns, torch.full_like(columns, width)).min(dim=1).values


def _last_true(mask: torch.Tensor) -> torch.Tensor:
    """(bs,) index of the last nonzero column of each row (-1 if none)."""
    columns = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask > 0, columns, torch.full_like(columns, -1)).max(dim=1).values


def row_widths(prompt_mask: torch.Tensor, response_attention: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row ``(prompt_width, response_width)``, both (bs,) long and >= 1 (see module docstring).

    Args:
        prompt_mask: (bs, P) 1 on real prompt tokens (left padding 0), P >= 1.
        response_attention: (bs, T) 1 on real response-slot tokens (right padding 0), T >= 1.
    """
    if prompt_mask.dim() != 2 or response_attention.dim() != 2 or prompt_mask.shape[0] != response_attention.shape[0]:
        raise ValueError(f"prompt_mask {tuple(prompt_mask.shape)} and response_attention "
                         f"{tuple(response_attention.shape)} must be (bs, P) and (bs, T)")
    prompt_len = prompt_mask.shape[1]
    if prompt_len < 1 or response_attention.shape[1] < 1:
        raise ValueError("row_widths needs at least one prompt column and one response column")
    prompt_width = (prompt_len - _first_true(prompt_mask)).clamp(min=1)
    response_width = (_last_true(response_attention) + 1).clamp(min=1)
    return prompt_width.long(), response_width.long()


def trim_bounds(attention_mask: torch.Tensor, response_len: int) -> tuple[int, int]:
    """Columns ``[start, stop)`` of a ``[prompt | response]`` batch that are not padding in every row.

    ``start`` never passes the last prompt column and ``stop`` keeps at least one response column, so
    the response-aligned slice (columns ``T - R - 1 .. T - 2``) of the trimmed batch still exists.

    Args:
        attention_mask: (bs, P + R).
        response_len: R.

    Returns:
        ``(start, stop)`` with ``0 <= start <= P - 1`` and ``P + 1 <= stop <= P + R``.
    """
    total = attention_mask.shape[1]
    prompt_len = total - response_len
    if not 0 < response_len < total:
        raise ValueError(f"response_len must be in (0, {total}), got {response_len}")
    any_real = (attention_mask > 0).any(dim=0)
    real_columns = torch.nonzero(any_real).flatten()
    if real_columns.numel() == 0:
        return prompt_len - 1, prompt_len + 1
    start = min(int(real_columns[0]), prompt_len - 1)
    stop = max(int(real_columns[-1]) + 1, prompt_len + 1)
    return start, stop


def padded_tokens(prompt_width: torch.Tensor, response_width: torch.Tensor) -> int:
    """Tokens a micro-batch of these rows runs: ``n x (max prompt width + max response width)``."""
    if prompt_width.numel() == 0:
        return 0
    return int(prompt_width.numel() * (int(prompt_width.max()) + int(response_width.max())))


def pack_rows(
    prompt_width: torch.Tensor,
    response_width: torch.Tensor,
    max_tokens: int | None = None,
    max_rows: int | None = None,
) -> list[torch.Tensor]:
    """Split rows ``0..bs-1`` into consecutive micro-batches (see the module docstring's rule).

    Args:
        prompt_width, response_width: (bs,) from :func:`row_widths`.
        max_tokens: padded-token budget per micro-batch; ``None`` = unbounded.
        max_rows: row cap per micro-batch; ``None`` = unbounded.

    Returns:
        A list of 1-D long tensors of row indices; their concatenation is ``arange(bs)``.
    """
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens_per_micro_batch must be >= 1 or null, got {max_tokens}")
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"micro_batch_size must be >= 1 or null, got {max_rows}")
    prompt_w = [int(w) for w in prompt_width.tolist()]
    response_w = [int(w) for w in response_width.tolist()]
    groups: list[list[int]] = []
    current: list[int] = []
    widest_prompt = widest_response = 0
    for row, (p_w, r_w) in enumerate(zip(prompt_w, response_w)):
        if current:
            grown = (len(current) + 1) * (max(widest_prompt, p_w) + max(widest_response, r_w))
            over_budget = max_tokens is not None and grown > max_tokens
            over_rows = max_rows is not None and len(current) + 1 > max_rows
            if over_budget or over_rows:
                groups.append(current)
                current, widest_prompt, widest_response = [], 0, 0
        current.append(row)
        widest_prompt, widest_response = max(widest_prompt, p_w), max(widest_response, r_w)
    if current:
        groups.append(current)
    return [torch.tensor(group, dtype=torch.long) for group in groups]


def split_to_count(groups: list[torch.Tensor], count: int) -> list[torch.Tensor]:
    """Split the largest groups in two (keeping row order) until there are ``count`` of them.

    Raises:
        ValueError: when there are fewer rows than ``count`` (a rank cannot run more non-empty
            micro-batches than it has rows).
    """
    rows = sum(int(g.numel()) for g in groups)
    if count > rows:
        raise ValueError(
            f"another data-parallel rank needs {count} micro-batches but this rank has only {rows} rows; "
            "give every rank the same number of rows (or raise trainer.max_tokens_per_micro_batch)"
        )
    groups = list(groups)
    while len(groups) < count:
        largest = max(range(len(groups)), key=lambda i: int(groups[i].numel()))
        group = groups[largest]
        half = int(group.numel()) // 2
        groups[largest:largest + 1] = [group[:half], group[half:]]
    return groups


@dataclass(frozen=True)
class MicroBatchPlan:
    """How a role splits a batch: a padded-token budget and/or a row cap (both optional).

    Attributes:
        max_tokens: ``trainer.max_tokens_per_micro_batch``; ``None`` = no token budget.
        max_rows: ``trainer.micro_batch_size``; ``None`` = no row cap.
    """

    max_tokens: int | None = None
    max_rows: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or int(self.max_tokens) < 1):
            raise ValueError(f"trainer.max_tokens_per_micro_batch={self.max_tokens!r}; use an integer >= 1 or null")
        if self.max_rows is not None and (isinstance(self.max_rows, bool) or int(self.max_rows) < 1):
            raise ValueError(f"trainer.micro_batch_size={self.max_rows!r}; use an integer >= 1 or null")

    def split(self, batch: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """Row-index groups of a collated batch (``prompt_mask``, ``response_attention``), in order.

        Under data parallelism every rank gets the same number of groups (one all-reduce of the count).
        """
        prompt_width, response_width = row_widths(batch["prompt_mask"], batch["response_attention"])
        groups = pack_rows(prompt_width, response_width, self.max_tokens, self.max_rows)
        if dist.get_world_size() > 1:
            count = torch.tensor([len(groups)], dtype=torch.long, device=dist.current_device())
            dist.all_reduce_max(count)
            groups = split_to_count(groups, int(count.item()))
        return groups
