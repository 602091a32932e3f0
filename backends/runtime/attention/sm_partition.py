"""FA3's paged prefill on fewer SMs than the device has (a step on encode_prefill's green context).

flashinfer's FA3 plan on Hopper (``PrefillSM90Plan``, include/flashinfer/attention/scheduler.cuh, flashinfer 0.6)
deals its work items (one per query head and query tile of 128 rows, 192 for head_dim 64) out to one persistent CTA
per SM of the *device* (``cudaDevAttrMultiProcessorCount``: 132 on the H200, also inside a green context), each CTA
a fixed list. On a green context of fewer SMs the CTAs beyond its count wait for a free SM and then run their whole
list: the kernel takes two rounds of lists instead of one. :func:`row_groups` cuts a step's query rows into groups of
at most ``sms`` work items each; one kernel call per group then runs in a single round (each CTA one item or none).
On the H200 (bench/results/green-context-probe-h200-2026-12-04/): a 2,048-row chunk over 100,000 cached tokens, 5.6 ms
on the whole GPU, took 9.3 ms on 120 SMs in one call and 5.6 ms in four; cuBLAS's GEMMs of the same steps took the
time their share of SMs predicts (1.12x on 120), with or without torch's SM carveout.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

Piece = tuple[int, int, int]  # (sequence, first query row, end row), rows counted within the sequence's new tokens


def tile_rows(head_dim: int) -> int:
    """Query rows of one FA3 work item (flashinfer's ``cta_tile_q``: 192 for head_dim 64, else 128)."""
    return 192 if head_dim == 64 else 128


def row_groups(qo_lens: Sequence[int], num_qo_heads: int, head_dim: int, sms: int) -> list[list[Piece]]:
    """The step's query rows in order, cut into groups whose FA3 work items (``num_qo_heads`` per started tile of
    ``tile_rows(head_dim)`` rows of each sequence) are at most ``sms``; at least one tile a group. A sequence's rows
    may span groups (cut at whole tiles); a group's rows are contiguous in the step's ragged query tensor.

    ``qo_lens``: each sequence's new tokens (>= 1). Returns one group per list, each a list of
    ``(sequence, start, end)`` pieces. Raises ValueError for ``sms < 1``.
    """
    if sms < 1:
        raise ValueError(f"sms must be at least 1, got {sms}")
    tile = tile_rows(head_dim)
    rows_per_group = max(1, sms // num_qo_heads) * tile
    groups: list[list[Piece]] = []
    current: list[Piece] = []
    room = rows_per_group
    for seq, n in enumerate(qo_lens):
        start = 0
        while start < n:
            end = start + min(n - start, room)
            current.append((seq, start, end))
            room -= -(-(end - start) // tile) * tile  # a partial tile is a whole work item
            start = end
            if room <= 0:
                groups.append(current)
                current, room = [], rows_per_group
    if current:
        groups.append(current)
    return groups


def group_rows(pieces: Sequence[Piece], cu_seqlens_q: Sequence[int]) -> slice:
    """The rows of the step's ragged query tensor that a group's pieces hold (``cu_seqlens_q``: each sequence's
    first row, then the total); contiguous, as :func:`row_groups` makes them."""
    (first_seq, first_row, _), (last_seq, _, last_row) = pieces[0], pieces[-1]
    return slice(int(cu_seqlens_q[first_seq]) + first_row, int(cu_seqlens_q[last_seq]) + last_row)


def group_layout(pieces: Sequence[Piece], qo_lens: Sequence[int], kv_indptr: np.ndarray, kv_indices: np.ndarray,
                 kv_last_page_len: np.ndarray, page_size: int) -> tuple[np.ndarray, ...]:
    """flashinfer's plan arrays (int32 ``qo_indptr``, ``kv_indptr``, ``kv_indices``, ``kv_last_page_len``) for one
    group's pieces: a piece's rows ``start .. end`` of a sequence with ``n`` new tokens and ``kv`` tokens in all
    (its cache and this step's) see the sequence's first ``kv - n + end`` tokens, so the causal mask, aligned to the
    end of the KV, gives row ``j`` the same tokens as in the whole step.

    ``kv_indptr``/``kv_indices``/``kv_last_page_len``: the whole step's page layout (``AttentionMetadata``'s)."""
    qo, indptr, indices, last = [0], [0], [], []
    for seq, start, end in pieces:
        pages = kv_indices[kv_indptr[seq]:kv_indptr[seq + 1]]
        kv = (len(pages) - 1) * page_size + int(kv_last_page_len[seq]) - qo_lens[seq] + end
        used = -(-kv // page_size)
        qo.append(qo[-1] + end - start)
        indices.append(pages[:used])
        indptr.append(indptr[-1] + used)
        last.append(kv - (used - 1) * page_size)
    as_int32 = lambda values: np.asarray(values, dtype=np.int32)  # noqa: E731
    return as_int32(qo), as_int32(indptr), np.concatenate(indices).astype(np.int32), as_int32(last)
