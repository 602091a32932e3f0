import sys, time, json, resource
sys.path.insert(0, sys.argv[1])
from flashcodec.gop import analyse_bitstream
from flashcodec.probe import probe_video
p = "/tmp/fcb/h264_1080p_10min.mp4"
a, q = [], []
for i in range(5):
    t = time.perf_counter(); analyse_bitstream(p); a.append(time.perf_counter() - t)
    t = time.perf_counter(); probe_video(p); q.append(time.perf_counter() - t)
print(json.dumps({"tree": sys.argv[1], "analyse_s": sorted(a), "probe_s": sorted(q), "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
