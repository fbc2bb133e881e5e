"""Length-sorted batch packing under a token budget (shared by the teacher and the student)."""

from __future__ import annotations

import torch


def pack_batches(lengths: list[int], *, max_batch: int, token_budget: int | None = None,
                 extra_tokens: int = 0) -> list[list[int]]:
    """Group prompt indices into batches, longest first.

    A batch is padded to its longest member, so it costs batch x (longest + extra_tokens)
    token slots; that must stay within ``token_budget`` and the batch within ``max_batch``.
    Sorting by length keeps padding small. A single prompt over budget still gets a batch
    of its own (the caller truncates over-long prompts beforehand).
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for index in order:
        # The batch's longest member is its first (sorted descending).
        longest = lengths[current[0]] if current else lengths[index]
        fits_budget = token_budget is None or (len(current) + 1) * (longest + extra_tokens) <= token_budget
        if current and (len(current) >= max_batch or not fits_budget):
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


def padding_efficiency(lengths: list[int], batches: list[list[int]], *, extra_tokens: int = 0) -> float:
    """Real token slots / computed token slots (extra tokens such as query rows count as real)."""
    real = sum(lengths) + extra_tokens * len(lengths)
    computed = sum(len(b) * (max(lengths[i] for i in b) + extra_tokens) for b in batches)
    return real / computed if computed else 1.0


def fixed_batches(count: int, size: int) -> list[list[int]]:
    """Naive batching: consecutive prompts in their original order (the baseline packing beats)."""
    return [list(range(start, min(start + size, count))) for start in range(0, count, size)]


def right_padded(rows: list[list[int]], *, pad_id: int, extra_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of shape [batch, longest + extra_tokens]: each row's tokens first,
    then ``extra_tokens`` positions that count as real (the teacher's query rows), then padding.

    Right padding keeps positions 0..n-1 for every row, and with causal attention no real
    position sees the padding, so a row's result does not depend on its batch mates.
    """
    width = max((len(r) for r in rows), default=0) + extra_tokens
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, :len(row) + extra_tokens] = 1
    return ids, mask
