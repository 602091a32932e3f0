import json, queue, time, re, base64, sys, subprocess
import numpy as np
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

GRPC = "127.0.0.1:28001"; HTTP = "http://127.0.0.1:28000"; MET = "http://127.0.0.1:28002/metrics"
MODEL = "orchestrator"

def metrics():
    t = requests.get(MET).text
    out = {}
    for line in t.splitlines():
        if line.startswith("unifiedserve_") and "{" not in line:
            k, v = line.split()
            out[k] = float(v)
    return out

def pages():
    m = metrics()
    return {k: m.get(k) for k in ["unifiedserve_kv_pages_free","unifiedserve_kv_pages_total","unifiedserve_patch_pages_free","unifiedserve_patch_pages_total","unifiedserve_requests_running"]}

def idle_ok(wait=10):
    t0 = time.time()
    while time.time() - t0 < wait:
        p = pages()
        if p["unifiedserve_kv_pages_free"] == p["unifiedserve_kv_pages_total"] and p["unifiedserve_patch_pages_free"] == p["unifiedserve_patch_pages_total"] and p["unifiedserve_requests_running"] == 0:
            return True, p
        time.sleep(0.5)
    return False, pages()

def bytes_input(name, data):
    arr = np.array([data], dtype=np.object_)
    i = grpcclient.InferInput(name, [1], "BYTES"); i.set_data_from_numpy(arr); return i

def bool_input(name, v):
    i = grpcclient.InferInput(name, [1], "BOOL"); i.set_data_from_numpy(np.array([v], dtype=bool)); return i

def grpc_gen(text="Describe.", image=None, video=None, sampling=None, stream=True, extra=None, timeout=120, cancel_after=None, raw_inputs=None, outputs=None):
    """Returns (chunks_text, error_str, final_dict)."""
    q = queue.Queue()
    c = grpcclient.InferenceServerClient(GRPC)
    try:
        c.start_stream(callback=lambda result, error: q.put((result, error)))
        if raw_inputs is not None:
            inputs = raw_inputs
        else:
            inputs = [bytes_input("text_input", text.encode() if isinstance(text, str) else text)]
            if image is not None:
                for im in (image if isinstance(image, list) else [image]):
                    pass
                imgs = image if isinstance(image, list) else [image]
                arr = np.array(imgs, dtype=np.object_)
                i = grpcclient.InferInput("image", [len(imgs)], "BYTES"); i.set_data_from_numpy(arr); inputs.append(i)
            if video is not None:
                inputs.append(bytes_input("video", video))
            if sampling is not None:
                inputs.append(bytes_input("sampling_parameters", sampling if isinstance(sampling, (str, bytes)) else json.dumps(sampling)))
            inputs.append(bool_input("stream", stream))
            if extra: inputs += extra
        c.async_stream_infer(MODEL, inputs, request_id="r", enable_empty_final_response=True, outputs=outputs)
        texts, err, fin = [], None, {}
        t0 = time.time(); n = 0
        while True:
            try:
                r, e = q.get(timeout=timeout)
            except queue.Empty:
                err = "CLIENT TIMEOUT (hang?)"; break
            if e is not None:
                err = str(e); break
            n += 1
            res = r.get_response()
            for name in ("text_output", "finish_reason", "num_input_tokens", "num_output_tokens", "output_ids"):
                try:
                    v = r.as_numpy(name)
                except Exception:
                    v = None
                if v is not None:
                    if name == "text_output":
                        texts.append(v[0])
                    else:
                        fin[name] = v.tolist()
            final = res.parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                break
            if cancel_after is not None and n >= cancel_after:
                c.stop_stream(cancel_requests=True)
                return texts, "CANCELLED_BY_CLIENT", fin
        return texts, err, fin
    finally:
        try: c.stop_stream()
        except Exception: pass
        c.close()
