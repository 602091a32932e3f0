"""What CUDA graphs decide on the host (CPU): rung ladders and the rung a step replays
(``graph_capture``), the prefill graphs' padding and scratch-page rules, capture layout and what a graphed chunk plans
and stages (``prefill_graphs``: its graphs stood in for), which prefill steps run graphed (``ModelRunner.prefill``),
the prefill kernel rule (``flashinfer_backend``), and when a decode graph planned ahead still fits (``cuda_graphs``).
The graphs themselves: tests/gpu/test_prefill_graphs.py and test_flashinfer_runtime.py."""
import random
from types import SimpleNamespace

import pytest
import torch

from backends.runtime.attention import AttentionMetadata, TorchAttentionBackend
from backends.runtime.attention.flashinfer_backend import prefill_kernel
from backends.runtime.language_model.cuda_graphs import _Planned, batch_ladder
from backends.runtime.language_model.graph_capture import ladder, rung_for
from backends.runtime.language_model.kv_cache import KVCacheLayout, pages_needed
from backends.runtime.language_model.prefill_graphs import (PREFILL_RUNGS, PrefillGraphs, _Graph, append_positions,
                                                             capture_layout)
from backends.runtime.loader import ModelSpec, load_model
from backends.runtime.model_runner import ModelRunner, PrefillChunk


def test_ladders_end_at_their_top():
    assert batch_ladder(8) == (1, 2, 4, 8)
    assert batch_ladder(100) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100)
    assert ladder(PREFILL_RUNGS, 512) == PREFILL_RUNGS
    assert ladder(PREFILL_RUNGS, 200) == (16, 32, 64, 128, 200)
    with pytest.raises(ValueError, match="at least 1"):
        batch_ladder(0)


@pytest.mark.parametrize("n, rung", [(1, 16), (16, 16), (17, 32), (50, 64), (117, 128), (129, 256), (512, 512)])
def test_a_chunk_replays_the_smallest_rung_that_holds_it(n, rung):
    assert rung_for(PREFILL_RUNGS, n) == rung


@pytest.mark.parametrize("n", [0, 513])
def test_no_rung_outside_the_ladder(n):
    with pytest.raises(ValueError, match=f"{n} rows; the graphs hold 1 .. 512"):
        rung_for(PREFILL_RUNGS, n)


def _slot(pages: list[int], position: int, page_size: int) -> int:
    """The flat slot ``append_paged_kv_cache`` writes for ``position`` of one sequence over ``pages``."""
    return pages[position // page_size] * page_size + position % page_size


@pytest.mark.parametrize("n, cached, rows", [(3, 20, 16), (16, 0, 16), (117, 0, 128), (50, 14432, 64), (1, 31, 16)])
def test_real_rows_write_their_own_slots_and_padding_rows_only_the_scratch_slot(n, cached, rows):
    """The graph's KV writes see "scratch page, then the sequence's pages" as one sequence: each real row lands
    where the eager step writes it (``AttentionMetadata.slot_mapping``), each padding row in the scratch page's slot
    0, and no row anywhere else."""
    page_size, scratch = 16, 9999
    rng = random.Random(n + cached)
    table = rng.sample(range(9000), pages_needed(cached + n, page_size) + 2)  # longer than needed, as reserved
    metadata = AttentionMetadata.build([n], [cached], [table], page_size, "cpu")
    positions = append_positions(metadata.kv_positions, rows, page_size)
    assert positions.dtype == torch.int32 and positions.shape == (rows,)
    slots = [_slot([scratch, *table], int(p), page_size) for p in positions]
    assert slots[:n] == metadata.slot_mapping.tolist()
    assert slots[n:] == [scratch * page_size] * (rows - n)


def test_a_chunk_larger_than_the_graph_is_refused():
    with pytest.raises(ValueError, match="17 tokens do not fit a graph of 16 rows"):
        append_positions(torch.arange(17, dtype=torch.int32), 16, 16)


@pytest.mark.parametrize("rows", PREFILL_RUNGS)
def test_graphs_are_captured_over_the_scratch_page_alone(rows):
    """flashinfer sizes a graph for the rows of its first plan: all the rung's rows, over KV that is all scratch."""
    metadata = capture_layout(rows, scratch=41, page_size=16)
    assert metadata.cu_seqlens_q.tolist() == [0, rows]
    assert set(metadata.kv_indices.tolist()) == {41} and metadata.kv_indices.numel() == pages_needed(rows, 16)
    assert set((metadata.slot_mapping // 16).tolist()) == {41}


@pytest.mark.parametrize("qo_lens, heads, head_dim, sms, kernel", [
    ([16], 28, 128, 132, "fa2"),          # Qwen2.5-VL-7B: 28 work items on 132 SMs
    ([512], 28, 128, 132, "fa2"),         # 4 tiles x 28 heads = 112
    ([513], 28, 128, 132, "auto"),        # 5 tiles x 28 = 140: FA3 fills the GPU
    ([117, 117], 28, 128, 132, "fa2"),    # 56
    ([512, 1], 28, 128, 132, "auto"),     # 140
    ([384], 40, 128, 132, "fa2"),         # InternVL3-38B's 40 heads: 120
    ([385], 40, 128, 132, "auto"),        # 160
    ([576], 28, 64, 100, "fa2"),          # head_dim 64: tiles of 192 rows, 3 x 28 = 84
    ([577], 28, 64, 100, "auto"),         # 4 x 28 = 112
    ([512], 28, 128, 66, "auto"),         # under MPS, a share of the SMs
])
def test_prefill_kernel_is_fa2_while_fa3_work_items_leave_sms_idle(qo_lens, heads, head_dim, sms, kernel):
    assert prefill_kernel(qo_lens, heads, head_dim, sms) == kernel


class _Graphs:
    """Stands in for ``PrefillGraphs`` (which needs CUDA): records the chunks it is given."""

    max_rows = 16

    def __init__(self):
        self.chunks = []

    def run(self, chunk):
        self.chunks.append(chunk)
        return torch.zeros(1, 7)


def test_one_sequence_of_at_most_the_top_rung_runs_graphed_and_other_steps_eagerly():
    model, _ = load_model(ModelSpec())
    layout = KVCacheLayout.from_config(model.config, num_pages=9, page_size=16)
    runner = ModelRunner(model, torch.zeros(layout.shape), 16, TorchAttentionBackend())
    runner.prefill_graphs = graphs = _Graphs()

    def chunk(n, table):
        return PrefillChunk(runner.embed(torch.arange(3, 3 + n)), torch.arange(n).expand(3, -1), 0, table, True)

    one = chunk(16, [0])
    assert runner.prefill([one]).shape == (1, 7) and graphs.chunks == [one]
    vocab = model.lm_head.out_features
    assert runner.prefill([chunk(17, [1, 2])]).shape == (1, vocab)             # above the top rung
    assert runner.prefill([chunk(5, [3]), chunk(5, [4])]).shape == (2, vocab)  # two sequences
    assert graphs.chunks == [one]


class _Staging:
    """Stands in for ``PinnedStaging`` (pinned memory needs CUDA): a CPU buffer, as ``take`` hands it out."""

    def __init__(self, numel):
        self.buffer = torch.full((numel,), -1, dtype=torch.int32)

    def take(self, *shape):
        return self.buffer[:torch.Size(shape).numel()].view(shape)

    def sent(self):
        pass


class _Layout:
    """Stands in for ``LayoutStaging``: records each plan's layout."""

    def __init__(self):
        self.plans = []

    def plan(self, backend, metadata):
        self.plans.append((backend, metadata))


def _host_side_graphs(rungs, hidden_size=8, position_rows=3, page_size=16):
    """A ``PrefillGraphs`` whose host part is real (``run``: rung, layout, staged positions, embeddings, last row) and
    whose graphs are stand-ins that copy the embeddings to the hidden states, so that a run returns its chunk's last
    embedding row (through an identity LM head)."""
    graphs = object.__new__(PrefillGraphs)
    graphs.rungs, graphs.max_rows = tuple(rungs), max(rungs)
    graphs.runner = SimpleNamespace(family=SimpleNamespace(position_rows=position_rows), page_size=page_size,
                                    model=SimpleNamespace(lm_head=torch.nn.Identity()))
    graphs._layout, graphs._staging = _Layout(), _Staging((position_rows + 1) * max(rungs))
    graphs._graphs = {}
    for rows in rungs:
        embeds = torch.full((rows, hidden_size), float("nan"))
        hidden = torch.zeros(rows, hidden_size)
        replay = (lambda e, h: lambda: h.copy_(e))(embeds, hidden)
        graphs._graphs[rows] = _Graph(rows, SimpleNamespace(replay=replay), f"backend-{rows}", embeds,
                                      torch.full((position_rows + 1, rows), -1, dtype=torch.int32), hidden)
    return graphs


def test_a_graphed_chunk_plans_its_real_rows_over_its_whole_context_and_stages_its_own_rows():
    """The host part of a graphed chunk over a cached context, after larger chunks left their rows in the buffers:
    flashinfer is planned for the chunk's real rows over all ``c + n`` KV tokens (qo indptr ``[0, n]``, the
    sequence's pages, the last page's length), the graph's positions are the chunk's then zeros, its KV positions
    those of the eager step's slots (``append_positions``) then the scratch slot, and the returned row is the chunk's
    last."""
    graphs = _host_side_graphs((16, 64, 128))
    rng = random.Random(11)
    table = rng.sample(range(500), 40)
    for n, cached in [(100, 0), (60, 100), (5, 160), (1, 165), (16, 166), (64, 182)]:
        embeds = torch.randn(n, 8)
        positions = torch.arange(cached, cached + n).expand(3, -1) + torch.tensor([[0], [1000], [2000]])
        out = graphs.run(PrefillChunk(embeds, positions, cached, table, want_logits=True))
        rows = rung_for(graphs.rungs, n)
        g = graphs._graphs[rows]
        backend, metadata = graphs._layout.plans[-1]
        pages = pages_needed(cached + n, 16)
        assert backend == f"backend-{rows}"
        assert metadata.cu_seqlens_q.tolist() == [0, n] and metadata.num_cached.tolist() == [cached]
        assert metadata.kv_indptr.tolist() == [0, pages] and metadata.kv_indices.tolist() == table[:pages]
        assert metadata.kv_last_page_len.tolist() == [cached + n - (pages - 1) * 16]
        assert g.inputs[:3, :n].tolist() == positions.tolist() and not g.inputs[:3, n:].any()
        eager = AttentionMetadata.build([n], [cached], [table], 16, "cpu")
        slots = [_slot([9999, *table], int(p), 16) for p in g.inputs[3]]
        assert slots[:n] == eager.slot_mapping.tolist() and set(slots[n:]) <= {9999 * 16}
        assert torch.equal(g.embeds[:n], embeds) and torch.equal(out, embeds[-1:])
    assert graphs.run(PrefillChunk(torch.randn(3, 8), torch.zeros(3, 3, dtype=torch.long), 246, table, False)
                      ).shape == (0, 8)


def test_a_decode_plan_made_ahead_fits_a_table_grown_past_the_pages_it_reads():
    """Decode's next step is planned while the step before runs; a page granted meanwhile (``DecodeGrow``, a new
    table object) past the pages the step reads keeps the plan, a changed page read or another count does not."""
    import numpy as np
    from backends.runtime.model_runner import DecodeSeq
    table = np.array([3, 7], dtype=np.int32)
    planned = _Planned(None, None, ((20, table),), page_size=16)  # token 20's KV: pages 0-1 read
    seq = lambda t, cached=20: [DecodeSeq(0, cached, cached, t)]  # noqa: E731
    assert planned.fits(seq(table)) and planned.fits(seq(np.array([3, 7, 9], dtype=np.int32)))
    assert not planned.fits(seq(np.array([3, 8, 9], dtype=np.int32))) and not planned.fits(seq(table, 21))
    assert not planned.fits(seq(np.array([3], dtype=np.int32))) and not planned.fits(seq(table) * 2)
