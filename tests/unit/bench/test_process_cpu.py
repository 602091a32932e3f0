"""bench/peer/process_cpu.py on this process (CPU seconds from /proc, busy shares, no server under a plain pid) and
bench/peer/gpu_busy.py's arithmetic."""
import os
import subprocess
import time

from bench.peer import process_cpu


def test_cpu_seconds_grow_with_work_and_busy_is_their_share_of_the_wall():
    before = process_cpu.cpu_seconds(os.getpid())
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    after = process_cpu.cpu_seconds(os.getpid())
    assert after - before >= 0.15
    assert process_cpu.busy({"a": 1.0, "b": 0.0}, {"a": 1.5, "b": 2.0, "c": 9.0}, 2.0) == {"a": 0.25, "b": 1.0}


def test_a_gone_process_and_a_process_without_a_server():
    assert process_cpu.cpu_seconds(2**22 + 12345) is None
    # a process with no children (not this one: the e2e tests' server may be its child)
    with subprocess.Popen(["sleep", "30"]) as child:
        try:
            assert process_cpu.server_processes(child.pid) == {}
        finally:
            child.kill()


def test_gpu_busy_means_skip_lines_that_are_not_numbers():
    from bench.peer.gpu_busy import GpuSampler, summarize

    assert summarize("80, 10\n100, 30\n[N/A], [N/A]\n6") == {"gpu_busy_pct": 90.0, "decoder_busy_pct": 20.0,
                                                               "samples": 2}
    assert summarize("") is None
    with GpuSampler() as sampler:  # no nvidia-smi on the CPU machines: nothing sampled, nothing raised
        pass
    assert sampler.result is None or sampler.result["samples"] >= 0


def test_children_lists_a_child_with_its_command_line():
    # how the OpenAI API's uvicorn workers are found and counted with it
    with subprocess.Popen(["sleep", "30"]) as child:
        try:
            assert process_cpu.children(os.getpid())[child.pid] == ("sleep", b"sleep\x0030\x00")
        finally:
            child.kill()
