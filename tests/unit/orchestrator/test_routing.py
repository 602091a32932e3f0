"""Which replica's engine a new request goes to (orchestrator/routing.py)."""
from orchestrator.engine import Engine
from orchestrator.pages import PageAllocator
from orchestrator.prefix_cache import PrefixCache
from orchestrator.routing import choose
from orchestrator.scheduler import Scheduler, SchedulerConfig
from orchestrator.sequence import Sequence


def replica(index: int, pages: int, requests: int = 0, used: int = 0) -> Engine:
    """An engine (never started: routing reads its scheduler and its requests) with ``requests`` requests."""
    kv, patch = PrefixCache(PageAllocator(pages, "kv")), PageAllocator(4, "patch")
    kv.grant([], used, 0, 0)
    engine = Engine(index, Scheduler(SchedulerConfig(), kv, patch), patch, stages=None, media=None)
    engine.requests.update({f"r{k}": None for k in range(requests)})
    return engine


def test_fewest_requests_then_most_free_pages_then_lowest_index():
    assert choose([replica(0, 10, 2), replica(1, 10, 1)], 8, 8).index == 1
    assert choose([replica(0, 10, 1, used=5), replica(1, 10, 1, used=2)], 8, 8).index == 1
    assert choose([replica(0, 10), replica(1, 10)], 8, 8).index == 0


def test_a_replica_that_cannot_hold_the_request_or_lost_its_decode_stream_is_skipped():
    small, big = replica(0, 4), replica(1, 40, requests=5)
    assert choose([small, big], 100, 60) is big  # 10 pages of 16 tokens
    big.decode_ended = "decode: the stage crashed"
    assert choose([small, big], 100, 60) is None
    assert choose([small, big], 16, 16) is small


def test_a_replica_that_can_start_the_request_now_comes_first():
    """Replica 0 has fewer requests but only 4 free pages; a 5-page request would wait there, so it goes to
    replica 1, which has room (a fresh user's two-replica case). A request that fits both goes by load."""
    busy, roomy = replica(0, 64, requests=1, used=60), replica(1, 64, requests=2, used=58)
    assert choose([busy, roomy], 64, 16) is roomy  # 5 pages of 16 tokens
    assert choose([busy, roomy], 48, 16) is busy  # 4 pages
    # a replica whose queue holds a waiting request admits a newcomer only within its backfill rule
    roomy.scheduler.add(Sequence("waiting", 16 * 62 - 8, 8))  # 62 pages: it leaves 2 of the pool over
    assert not roomy.scheduler.admits_now(64, 16) and roomy.scheduler.admits_now(16, 16)
    assert choose([busy, roomy], 64, 16) is busy  # neither starts it now: by load


def test_a_lone_replica_that_fits_is_chosen_without_asking_its_scheduler_about_admission():
    """Admission's look over every request (``admits_now``) has nothing to choose between with one replica."""
    alone = replica(0, 64, requests=3, used=60)

    def asked(*_):
        raise AssertionError("admits_now asked with one replica")

    alone.scheduler.admits_now = asked
    assert choose([alone], 64, 16) is alone  # it would wait there: there is nowhere else
    assert choose([alone, replica(1, 4)], 64, 16) is alone  # the other cannot hold it
