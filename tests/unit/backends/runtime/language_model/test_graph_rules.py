"""What CUDA graphs decide on the host (CPU): rung ladders and the rung a step replays
(``graph_capture``), the prefill graphs' padding and scratch-page rules and capture layout (``prefill_graphs``),
which prefill steps run graphed (``ModelRunner.prefill``), and the prefill kernel rule (``flashinfer_backend``).
The graphs themselves: tests/gpu/test_prefill_graphs.py and test_flashinfer_runtime.py."""
import random

import pytest
import torch

from backends.runtime.attention import AttentionMetadata, TorchAttentionBackend
from backends.runtime.attention.flashinfer_backend import prefill_kernel
from backends.runtime.language_model.cuda_graphs import batch_ladder
from backends.runtime.language_model.graph_capture import ladder, rung_for
from backends.runtime.language_model.kv_cache import KVCacheLayout, pages_needed
from backends.runtime.language_model.prefill_graphs import PREFILL_RUNGS, append_positions, capture_layout
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
