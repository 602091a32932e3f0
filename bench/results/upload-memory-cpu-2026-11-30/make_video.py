import av, numpy as np, sys
out = sys.argv[1]; seconds = int(sys.argv[2])
with av.open(out, "w") as dst:
    s = dst.add_stream("libx264", rate=25, options={"preset": "ultrafast", "qp": "0"})
    s.width, s.height, s.pix_fmt = 640, 360, "yuv420p"
    rng = np.random.default_rng(0)
    base = rng.integers(0, 255, (360, 640, 3), dtype=np.uint8)
    for i in range(seconds * 25):
        img = np.roll(base, i * 3, axis=1)
        f = av.VideoFrame.from_ndarray(img, format="rgb24"); f.pts = i
        dst.mux(s.encode(f))
    dst.mux(s.encode())
