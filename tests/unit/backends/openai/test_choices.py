"""Several choices of one request (backends/openai/choices.py): seeds, when a prompt's other samples are sent, the
merged stream, errors and giving up. The orchestrator here is a recorder of what ``merged`` asks of it; the real
one answers in tests/e2e/test_openai_api.py."""
import asyncio
import contextlib
import dataclasses

import pytest

from backends.openai.choices import merged, sample_requests
from backends.openai.convert import OrchestratorRequest
from backends.openai.errors import ApiError
from client.pieces import ResponsePiece


def _request(prompt: str, **sampling) -> OrchestratorRequest:
    return OrchestratorRequest(prompt, None, (), sampling, True, False)


class Recorder:
    """Answers each request with its prompt and seed as two pieces, gated: a request's second piece waits until
    ``release`` names its prompt; ``fail`` names prompts answered with an error; ``log`` records sends and
    closes."""

    def __init__(self, fail: tuple[str, ...] = (), limit: int = 0):
        self.limit, self.in_flight = limit, 0
        self.log: list[tuple[str, str, int | None]] = []
        self.gates: dict[str, asyncio.Event] = {}
        self.fail = fail
        self.prefilled = asyncio.Event()  # every first response waits for it
        self.prefilled.set()

    def release(self, prompt: str) -> None:
        self.gates.setdefault(prompt, asyncio.Event()).set()

    @contextlib.contextmanager
    def reserved(self, requests: int):
        if self.limit and self.in_flight + requests > self.limit:
            raise ApiError(503, "the server is overloaded")
        self.in_flight += requests
        try:
            yield
        finally:
            self.in_flight -= requests

    async def generate(self, request: OrchestratorRequest, reserved: bool = False):
        seed = request.sampling.get("seed")
        assert request.stream and reserved == (self.in_flight > 0)  # whole replies too: their choices are streamed
        self.log.append(("sent", request.prompt, seed))
        try:
            if request.prompt in self.fail:
                raise ApiError(400, f"prompt: bad {request.prompt}")
            await self.prefilled.wait()
            yield ResponsePiece(f"{request.prompt}:{seed}".encode())
            await self.gates.setdefault(request.prompt, asyncio.Event()).wait()
            yield ResponsePiece(b".", finish_reason="stop", final=True)
        finally:
            self.log.append(("closed", request.prompt, seed))


def test_a_samples_seed_is_raised_by_its_index_and_every_sample_is_streamed():
    assert [r.sampling["seed"] for r in sample_requests(_request("p", seed=5), 3)] == [5, 6, 7]
    unseeded = sample_requests(dataclasses.replace(_request("p", top_k=2), stream=False), 2)
    assert all(r.sampling == {"top_k": 2} and r.stream for r in unseeded)


def test_a_requests_choices_are_counted_at_once_or_refused_before_any_is_sent():
    async def run():
        orchestrator = Recorder(limit=3)
        with pytest.raises(ApiError, match="overloaded"):
            async for _ in merged(orchestrator, [_request("a")], 4):
                pass
        assert orchestrator.log == [] and orchestrator.in_flight == 0
    asyncio.run(run())


def test_a_prompts_other_samples_are_sent_after_its_first_response():
    async def run():
        orchestrator = Recorder()
        orchestrator.prefilled.clear()
        stream = merged(orchestrator, [_request("a", seed=1), _request("b", seed=1)], 2)
        waiting = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.01)
        assert orchestrator.log == [("sent", "a", 1), ("sent", "b", 1)]  # the others wait for a first response
        orchestrator.prefilled.set()
        first = await waiting
        await asyncio.sleep(0)  # the other prompt's first response too
        sent = [entry for entry in orchestrator.log if entry[0] == "sent"]
        # each prompt's first sample went at once; each one's second after its first's first response
        assert sent[:2] == [("sent", "a", 1), ("sent", "b", 1)] and first == (0, ResponsePiece(b"a:1"))
        orchestrator.release("a")
        orchestrator.release("b")
        rest = [item async for item in stream]
        texts = {index: [] for index in range(4)}
        for index, piece in [first, *rest]:
            texts[index].append(piece.text)
        assert texts == {0: [b"a:1", b"."], 1: [b"a:2", b"."], 2: [b"b:1", b"."], 3: [b"b:2", b"."]}
        assert sorted(e[1:] for e in orchestrator.log if e[0] == "sent") == [("a", 1), ("a", 2), ("b", 1), ("b", 2)]
    asyncio.run(run())


def test_one_choices_error_gives_up_the_others_and_is_raised():
    async def run():
        orchestrator = Recorder(fail=("b",))
        with pytest.raises(ApiError, match=r"^prompt\[1\]: bad b$"):  # which prompt, where there are several
            async with contextlib.aclosing(merged(orchestrator, [_request("a"), _request("b")], 1)) as stream:
                async for _ in stream:
                    pass
        assert ("closed", "a", None) in orchestrator.log  # given up: its request is cancelled
    asyncio.run(run())


def test_closing_the_stream_gives_up_every_choice():
    async def run():
        orchestrator = Recorder()
        stream = merged(orchestrator, [_request("a")], 3)
        await anext(stream)
        await asyncio.sleep(0)
        await stream.aclose()
        closed = [e for e in orchestrator.log if e[0] == "closed"]
        assert len(closed) == 3 == len([e for e in orchestrator.log if e[0] == "sent"])
    asyncio.run(run())


def test_one_choice_is_the_requests_own_stream():
    async def run():
        orchestrator = Recorder()
        orchestrator.release("a")
        items = [item async for item in merged(orchestrator, [_request("a")], 1)]
        assert [index for index, _ in items] == [0, 0] and items[-1][1].finish_reason == "stop"
    asyncio.run(run())


class CancelledUnder:
    """An orchestrator whose call is cancelled under the request (grpc-aio cancels a call whose request iterator
    fails), with one choice or several; the request's own task is not being cancelled."""

    @contextlib.contextmanager
    def reserved(self, requests: int):
        yield

    async def generate(self, request: OrchestratorRequest, reserved: bool = False):
        if request.prompt == "ok":
            yield ResponsePiece(b"fine", finish_reason="stop", final=True)
            return
        raise asyncio.CancelledError


@pytest.mark.parametrize("prompts,n", [(["bad"], 1), (["ok", "bad"], 1), (["bad"], 2)])
def test_a_call_cancelled_under_a_choice_is_an_error_not_a_silent_end(prompts, n):
    async def run():
        pieces = []
        with pytest.raises(ApiError) as error:
            async for item in merged(CancelledUnder(), [_request(p) for p in prompts], n):
                pieces.append(item)
        return error.value

    error = asyncio.run(asyncio.wait_for(run(), 5))
    assert error.status == 500 and "cancelled" in error.message


class TokenIdsRefused(CancelledUnder):
    """Refuses prompt "b" as the orchestrator refuses a bad token id, prompt "long" as it refuses a long one."""

    async def generate(self, request: OrchestratorRequest, reserved: bool = False):
        if request.prompt == "b":
            raise ApiError(400, "prompt_token_ids: id 9 (position 0) is outside the vocabulary", param="prompt")
        if request.prompt == "long":
            raise ApiError(400, "prompt too long: its 40001 tokens leave no room", param="prompt")
        yield ResponsePiece(b"fine", finish_reason="stop", final=True)


def test_the_orchestrators_token_id_errors_name_the_apis_prompt():
    """``prompt_token_ids: ...`` (the orchestrator's input) comes back as ``prompt: ...``, or ``prompt[k]: ...``."""
    async def run(prompts):
        with pytest.raises(ApiError) as error:
            async for _ in merged(TokenIdsRefused(), [_request(p) for p in prompts], 1):
                pass
        return error.value.message, error.value.param

    assert asyncio.run(run(["b"])) == ("prompt: id 9 (position 0) is outside the vocabulary", "prompt")
    assert asyncio.run(run(["a", "b"])) == ("prompt[1]: id 9 (position 0) is outside the vocabulary", "prompt")
    # the prompt's length: which prompt, where the request has several
    assert asyncio.run(run(["long"])) == ("prompt too long: its 40001 tokens leave no room", "prompt")
    assert asyncio.run(run(["a", "long"])) == ("prompt[1]: prompt too long: its 40001 tokens leave no room", "prompt")


def test_a_prompts_first_sample_asks_for_its_choices_as_one_and_the_others_name_it():
    """The orchestrator admits a prompt's choices as one (orchestrator/choice_reservations.py): the first sample is
    sent with ``choices`` n under a request id of its own, the others with ``choice_of`` that id."""
    first, *others = sample_requests(_request("p", seed=5), 3)
    assert first.request_id and first.choices == 3 and first.choice_of is None
    assert all(r.choice_of == first.request_id and r.choices == 1 and r.request_id is None for r in others)
    assert len({r.request_id for r in sample_requests(_request("p"), 2)[:1] + [first]}) == 2  # an id per request
    tensors = {t.name(): t for t in first.inputs()}
    assert tensors["choices"].datatype() == "INT64" and "choice_of" not in tensors
    assert {t.name() for t in others[0].inputs()} >= {"choice_of"} and "choices" not in {
        t.name() for t in others[0].inputs()}
    alone, = sample_requests(_request("p"), 1)
    assert (alone.request_id, alone.choices, alone.choice_of) == (None, 1, None)
    asking = dataclasses.replace(_request("p"), return_prompt_ids=True)  # return_token_ids: the first sample asks
    assert [r.return_prompt_ids for r in sample_requests(asking, 3)] == [True, False, False]
    assert not {"choices", "choice_of"} & {t.name() for t in alone.inputs()}
