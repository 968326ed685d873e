"""llama.cpp's llama-server as the benchmarks' peer: started on 127.0.0.1 with the given
arguments, sent the same prompt token ids through /completion (greedy, no end of text), the
median prompt and generation tokens/s of ``reps`` runs after a warm-up, read from its own
timings. Used by tools/bench_models.py (GPU, -ngl 99) and tools/bench_cpu.py (CPU, -ngl 0)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path


def peer_bench(server: str | Path, model: Path, ids: list[int], n_gen: int, reps: int, server_args: list[str],
               port: int = 18080, timeout: float = 600) -> dict[str, float]:
    env = dict(os.environ, LD_LIBRARY_PATH=str(Path(server).parent))
    proc = subprocess.Popen([str(server), "-m", str(model), *server_args, "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(1200):
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except Exception:
                if proc.poll() is not None:
                    err = proc.stderr.read().decode()
                    Path(os.environ.get("OUT", "/tmp"), "peer_stderr.txt").write_text(err)
                    raise RuntimeError("llama-server died: " + err[-1500:]) from None
                time.sleep(0.5)
        pp, tg = [], []
        for i in range(reps + 1):
            body = json.dumps({"prompt": ids, "n_predict": n_gen, "cache_prompt": False, "temperature": 0,
                               "ignore_eos": True, "samplers": ["top_k"], "top_k": 1}).encode()
            req = urllib.request.Request(url + "/completion", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=timeout) as r:
                t = json.loads(r.read())["timings"]
            if i:  # the first run is the warm-up
                pp.append(t["prompt_per_second"])
                tg.append(t["predicted_per_second"])
        return {"pp": statistics.median(pp), "tg": statistics.median(tg)}
    finally:
        proc.terminate()
        proc.wait(30)
