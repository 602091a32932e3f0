"""Which replica a new request goes to (orchestrator/replica.py)."""
from orchestrator.pages import PageAllocator
from orchestrator.replica import Replica, choose
from orchestrator.scheduler import Scheduler, SchedulerConfig
from orchestrator.sequence import Sequence


def replica(index: int, pages: int, requests: int = 0, used: int = 0) -> Replica:
    kv, patch = PageAllocator(pages, "kv"), PageAllocator(4, "patch")
    kv.allocate(used)
    return Replica(index, kv, Scheduler(SchedulerConfig(), kv, patch), 16, requests=requests)


def test_fewest_requests_then_most_free_pages_then_lowest_index():
    assert choose([replica(0, 10, 2), replica(1, 10, 1)], 1).index == 1
    assert choose([replica(0, 10, 1, used=5), replica(1, 10, 1, used=2)], 1).index == 1
    assert choose([replica(0, 10), replica(1, 10)], 1).index == 0
    assert (replica(1, 10).encode_prefill, replica(1, 10).decode) == ("encode_prefill_r1", "decode_r1")
    assert (replica(0, 10).encode_prefill, replica(0, 10).decode) == ("encode_prefill", "decode")


def test_a_replica_that_cannot_hold_the_request_or_lost_its_decode_stream_is_skipped():
    small, big = replica(0, 4), replica(1, 40, requests=5)
    assert choose([small, big], 10) is big
    big.decode_ended = "decode: the stage crashed"
    assert choose([small, big], 10) is None
    assert choose([small, big], 2) is small


def test_a_replica_that_can_start_the_request_now_comes_first():
    """Replica 0 has fewer requests but only 4 free pages; a 5-page request would wait there, so it goes to
    replica 1, which has room (a fresh user's two-replica case). A request that fits both goes by load."""
    busy, roomy = replica(0, 64, requests=1, used=60), replica(1, 64, requests=2, used=58)
    assert choose([busy, roomy], 5) is roomy
    assert choose([busy, roomy], 4) is busy
    # a replica whose queue holds a waiting request admits a newcomer only within its backfill rule
    roomy.scheduler.add(Sequence("waiting", 16 * 62 - 8, 8))  # 62 pages: it leaves 2 of the pool over
    assert not roomy.scheduler.admits_now(5) and roomy.scheduler.admits_now(2)
    assert choose([busy, roomy], 5) is busy  # neither starts it now: by load
