import sys, time, threading, random, json; sys.path.insert(0,'/tmp/ut3'); from ut import *
path = sys.argv[1]; cancel_at = float(sys.argv[2]) if len(sys.argv) > 2 else None
big = open(path,'rb').read(); print("big MB", len(big)/1e6)
stop = False; lat = []
def small():
    while not stop:
        t0 = time.time(); t,e,f = grpc_gen("hi", sampling={"max_tokens":4}, timeout=120)
        lat.append((round(t0-T0,1), round(time.time()-t0,2), e)); time.sleep(0.5)
def smallimg():
    while not stop:
        t0 = time.time(); t,e,f = grpc_gen("hi", image=open('/tmp/in/rgb.webp','rb').read(), sampling={"max_tokens":4}, timeout=120)
        lat.append((round(t0-T0,1), round(time.time()-t0,2), "img", e)); time.sleep(0.5)
T0 = time.time()
ths = [threading.Thread(target=small), threading.Thread(target=smallimg)]; [t.start() for t in ths]
time.sleep(1)
q = queue.Queue(); c = grpcclient.InferenceServerClient(GRPC)
c.start_stream(callback=lambda result, error: q.put((time.time()-T0, result, error)))
t_send = time.time()-T0
c.async_stream_infer(MODEL, [bytes_input("text_input", b"Describe."), bytes_input("video", big), bytes_input("sampling_parameters", b'{"max_tokens":8}'), bool_input("stream", True)], enable_empty_final_response=True)
print("big sent (async) at", round(t_send,1))
first = None; err=None
deadline = time.time() + (cancel_at if cancel_at is not None else 400)
while time.time() < deadline:
    try: ts, r, e = q.get(timeout=0.5)
    except queue.Empty: continue
    if first is None: first = ts; print("big first response at", round(ts,1), "err", str(e)[:200] if e else None)
    if e is not None: err = e; break
    p = r.get_response().parameters.get("triton_final_response")
    if p is not None and p.bool_param: print("big final at", round(ts,1)); break
if cancel_at is not None:
    print("cancel big at", round(time.time()-T0,1), "pages:", pages()); c.stop_stream(cancel_requests=True)
else:
    c.stop_stream()
c.close()
time.sleep(3); stop = True; [t.join() for t in ths]
print("small latencies (t_start, secs, err):"); print(lat)
print("max small latency", max(l[1] for l in lat))
print("idle:", idle_ok(120))
