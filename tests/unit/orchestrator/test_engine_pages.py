"""The engine and KV pages granted as replies grow (``DecodeGrow``; tests/unit/orchestrator/test_engine.py's fake
stages): the pages go to decode after the sequence's admit, as its tokens come, and to a sequence that waited for one
once another request has released its pages."""
from __future__ import annotations

from tests.unit.orchestrator.test_engine import PAGE, World, outputs_of, run, settle


def has_room(w: World, req_id: str) -> bool:
    """Whether decode could make the sequence's next token: its KV has a page (decode_worker's rule)."""
    seq = w.engine.scheduler.get(req_id)
    return seq.prompt_len + seq.num_generated <= len(seq.block_table) * PAGE


def grants(w: World) -> list[tuple[str, tuple[int, ...]]]:
    return [grant for entry in w.log if entry[0] == "decode_grow" for grant in entry[1]]


def test_pages_reach_decode_after_its_admit_as_the_tokens_come():
    async def body(w: World):
        out = w.text("a", prompt_len=20, max_tokens=100)  # admitted with the pages of 20 + 1 + 32 tokens: 4
        await outputs_of(out, 1)
        for token in range(28):  # 29 tokens: less than a page left ahead; 20 + 29 + 32 tokens take 6 pages
            assert grants(w) == []
            w.stages.emit(("a", token, ""))
            await outputs_of(out, 1)
        table = w.engine.scheduler.get("a").block_table
        assert grants(w) == [("a", tuple(table[4:6]))] and w.log.index(("admit", "a")) < len(w.log) - 1
        w.stages.emit(("a", 0, "stop"))
        await outputs_of(out, 1)
    run(body)


def test_a_sequence_waiting_for_a_page_gets_it_when_another_request_is_released():
    """Two requests of 8 pages at worst in a pool of 12 both start; the second is refused the page that would leave
    neither able to finish, and waits in decode; the first's release sends it the page."""
    async def body(w: World):
        a, b = w.text("a", 20, 100), w.text("b", 20, 100)
        await outputs_of(a, 1)
        await outputs_of(b, 1)
        for token in range(98):
            w.stages.emit(*[(r, token, "") for r in ("a", "b") if r == "a" or has_room(w, r)])
            await settle(4)
        assert not has_room(w, "b") and w.engine.scheduler.get("b").num_generated < 100
        before = len(grants(w))
        w.stages.emit(("a", 0, "length"))  # its 100th token
        await outputs_of(a, 99)
        await settle()
        table = w.engine.scheduler.get("b").block_table
        assert ("freed", 0, False) in w.log and grants(w)[before:] == [("b", tuple(table[4:]))] and len(table) > 4
        assert has_room(w, "b")
        w.stages.emit(("b", 0, "stop"))
        await settle()
    run(body, kv=12)
