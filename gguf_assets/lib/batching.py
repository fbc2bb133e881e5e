"""Length-sorted batch packing under a token budget (shared by the teacher and the student)."""

from __future__ import annotations


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
