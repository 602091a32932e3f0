"""Orchestrator stub RSS across repeated large video uploads (gRPC bytes)."""
import subprocess, sys, threading, time, json
sys.path.insert(0, "/work/main")
from client.api import Client

def stub_pids():
    out = subprocess.run(["pgrep", "-fa", "triton_python_backend_stub"], capture_output=True, text=True).stdout
    pids = {}
    for line in out.splitlines():
        pid, cmd = line.split(" ", 1)
        for m in ("orchestrator", "flashcodec", "encode_prefill", "decode"):
            if f"/work/main/model_repository/{m}/" in cmd:
                pids.setdefault(m, int(pid))
    return pids

def rss(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    return 0

data = open(sys.argv[1], "rb").read()
pids = stub_pids(); print(pids, flush=True)
peak = {m: 0 for m in pids}; stop = False
def sample():
    while not stop:
        for m, p in pids.items():
            peak[m] = max(peak[m], rss(p))
        time.sleep(0.1)
threading.Thread(target=sample, daemon=True).start()
print("idle", {m: round(rss(p)) for m, p in pids.items()}, flush=True)
for i in range(int(sys.argv[2])):
    for m in peak: peak[m] = 0
    t = time.time()
    with Client(sys.argv[3]) as c:
        r = c.generate("Describe.", video=data, sampling={"max_tokens": 1, "fps": 1})
    time.sleep(2)
    print(i, round(time.time() - t, 1), "s", r.finish_reason, "after", {m: round(rss(p)) for m, p in pids.items()},
          "peak", {m: round(v) for m, v in peak.items()}, flush=True)
stop = True
