"""The encode_prefill stage's prompts (``backends/stages/encode_prefill_worker.py``, ``prompt_state.py``): a prompt
is embedded a prefill chunk at a time, its groups' visual rows in place, which gives exactly the whole prompt's
embeddings and positions; a prompt whose prefix is cached embeds only the tokens after it; a group's rows are let go
once prefill has passed them. CPU, tiny model, torch attention."""
import pytest
import torch

from backends.ipc import shared_tensor
from backends.ipc.protocol import MediaGrid, NewRequest, PrefillWork, SamplingParams, StepPlan
from backends.ipc.run_dir import RUN_DIR_ENV
from backends.runtime.language_model.kv_cache import KVCacheLayout
from backends.runtime.language_model.mrope import mrope_positions
from backends.runtime.loader import ModelSpec
from backends.runtime.model_runner import PrefillChunk
from backends.stages.encode_prefill_worker import EncodePrefillWorker
from backends.stages.prompt_state import PromptState

PAGE = 16
GRID = (2, 8, 12)  # two temporal-patch groups of 8x12 patches: 24 tokens each
GROUP_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(RUN_DIR_ENV, str(tmp_path_factory.mktemp("run")))
        worker = EncodePrefillWorker(ModelSpec(), torch.device("cpu"), attention_backend="torch")
        layout = KVCacheLayout.from_config(worker.model.config, num_pages=32, page_size=PAGE)
        pool = shared_tensor.create("kv_pool", layout.shape, layout.dtype, torch.device("cpu"))
        worker.runner  # maps the pool while the run directory is set
        yield worker
        worker.shutdown()
        pool.release()


def _prompt(config) -> tuple[tuple[int, ...], int]:
    """Text, a video of ``GRID`` (its pad tokens expanded), text; and the index of its first pad token."""
    head = [7, 8, 9, 10, 11, config.vision_start_token_id]
    tail = [config.vision_end_token_id] + list(range(20, 40))
    return tuple(head + [config.video_token_id] * (2 * GROUP_TOKENS) + tail), len(head)


def _reference(worker, ids: tuple[int, ...], at: int, groups: list[torch.Tensor]):
    """The whole prompt's embeddings with the groups' rows placed, and its positions."""
    embeds = worker.runner.embed(torch.tensor(ids))
    embeds[at:at + 2 * GROUP_TOKENS] = torch.cat(groups)
    positions, _ = mrope_positions(worker.model.config, ids, video_grid_thw=[GRID], second_per_grid_ts=[1.0])
    return embeds, positions


def _run(worker, request: NewRequest, bounds: list[int], pages: tuple[int, ...], monkeypatch):
    """Prefill ``request`` in chunks between ``bounds`` (one step each, registered with the first); returns the
    chunks the runner was given, the ids embedded, and the first token."""
    chunks, embedded = [], []
    prefill, embed = worker.runner.prefill_scored, worker.runner.embed
    monkeypatch.setattr(worker.runner, "prefill_scored", lambda cs: chunks.extend(cs) or prefill(cs))
    monkeypatch.setattr(worker.runner, "embed", lambda ids: embedded.append(ids.clone()) or embed(ids))
    first = None
    for n, (start, end) in enumerate(zip(bounds, bounds[1:])):
        work = PrefillWork(request.req_id, start, end, pages, is_last=end == bounds[-1])
        result = worker.execute(StepPlan(new=(request,) if n == 0 else (), encode=(), prefill=(work,)))
        first = result.first_tokens[0].token if result.first_tokens else first
    return chunks, embedded, first


def test_chunks_hold_the_whole_prompts_embeddings_and_a_cached_prefix_is_not_embedded(worker, monkeypatch):
    ids, at = _prompt(worker.model.config)
    generator = torch.Generator().manual_seed(0)
    groups = [0.2 * torch.randn(GROUP_TOKENS, worker.model.config.text_config.hidden_size, generator=generator)
              for _ in range(2)]
    worker.encoder_cache.update({b"g0": groups[0], b"g1": groups[1]})  # as an earlier request's encode kept them
    cached = ((at, b"g0"), (at + GROUP_TOKENS, b"g1"))
    embeds, positions = _reference(worker, ids, at, groups)
    pages = tuple(range(-(-len(ids) // PAGE)))

    # 13-token chunks: some start or end inside a group
    bounds = [*range(0, len(ids), 13), len(ids)]
    chunks, embedded, first = _run(worker, NewRequest("a", ids, (MediaGrid("video", GRID, 1.0),), GREEDY, 4, cached),
                                   bounds, pages, monkeypatch)
    assert torch.equal(torch.cat([c.embeds for c in chunks]), embeds)
    assert torch.equal(torch.cat([c.positions for c in chunks], dim=1), positions)
    assert [len(e) for e in embedded] == [end - start for start, end in zip(bounds, bounds[1:])]

    # the same prompt with its first 48 tokens cached (a prefix that ends inside group 1): a's pages hold their KV
    monkeypatch.undo()
    reference = worker.runner.prefill([PrefillChunk(embeds, positions, 0, [p + len(pages) for p in pages], True)])
    chunks, embedded, again = _run(worker, NewRequest("b", ids, (MediaGrid("video", GRID, 1.0),), GREEDY, 4, cached),
                                   [3 * PAGE, len(ids)], pages, monkeypatch)
    assert torch.equal(chunks[0].embeds, embeds[3 * PAGE:])
    assert torch.equal(torch.cat(embedded), torch.tensor(ids[3 * PAGE:]))
    assert first == again == int(reference.argmax(dim=-1)[0])
    assert not worker.prompts


def test_a_group_is_let_go_once_prefill_has_passed_it():
    ids = torch.arange(10)
    state = PromptState(ids, ids.unsqueeze(0), 0, None, {2: torch.full((3, 2), -1.0), 6: torch.full((2, 2), -2.0)})
    embed = lambda chunk: chunk.float().unsqueeze(1).repeat(1, 2)
    embeds, positions = state.chunk(0, 4, embed)
    assert embeds[:, 0].tolist() == [0, 1, -1, -1] and positions.tolist() == [[0, 1, 2, 3]]
    assert sorted(state.visual) == [2, 6]
    embeds, _ = state.chunk(4, 7, embed)
    assert embeds[:, 0].tolist() == [-1, 5, -2] and sorted(state.visual) == [6]
    embeds, _ = state.chunk(7, 10, embed)
    assert embeds[:, 0].tolist() == [-2, 8, 9] and not state.visual


def test_a_steps_attention_is_sized_to_the_sms_of_its_stream(worker, monkeypatch):
    """The runner's attention backend plans each step for the SMs its stream may use (StepStreams.step_sms: a green
    context's count in a fewer_sms step, None on the whole GPU), set before the step's prefill."""
    seen = []
    prefill, backend = worker.runner.prefill_scored, worker.runner.backend
    monkeypatch.setattr(worker.runner, "prefill_scored", lambda cs: seen.append(backend.sms_limit) or prefill(cs))
    monkeypatch.setattr(worker.streams, "step_sms", lambda fewer_sms: 120 if fewer_sms else None)
    ids, pages = tuple(range(7, 40)), tuple(range(3))
    request = NewRequest("sms", ids, (), GREEDY, 4, ())
    worker.execute(StepPlan(new=(request,), encode=(), prefill=(PrefillWork("sms", 0, 16, pages, False),),
                            fewer_sms=True))
    worker.execute(StepPlan(new=(), encode=(), prefill=(PrefillWork("sms", 16, len(ids), pages, True),)))
    assert seen == [120, None]
    assert not worker.prompts
