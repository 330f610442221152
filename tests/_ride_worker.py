"""A worker whose every push is recognisable: push (rank, step) adds W at index rank*T + step of ``w``.

With SGD lr=1 in sync mode over W workers, each applied push moves its own index of ``w`` by exactly -1: after
training, an index at 0 is a push lost, -1 applied once, -2 applied twice. Prints the counts as JSON, and per rank
the steps whose push was lost.
"""

import json
import sys
import time

import numpy as np

import psrt
from psrt.config import ClientConfig

endpoint, rank, workers, steps, step_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \
    float(sys.argv[5])
size = workers * steps
gaps, last = [], None
# Endpoint "-": join the job of the scheduler in PSRT_SCHEDULER, with rank PSRT_WORKER_ID.
servers = None if endpoint == "-" else [endpoint]
with psrt.Client(servers, rank=rank, num_workers=workers, config=ClientConfig(timeout=60)) as client:
    client.init({"w": np.zeros(size, np.float32)}, optimizer=psrt.SGD(lr=1.0))
    grad = np.zeros(size, np.float32)
    for step in range(steps):
        grad[:] = 0
        grad[rank * steps + step] = workers
        params = client.push_pull({"w": grad})
        now = time.monotonic()
        if last is not None:
            gaps.append(now - last)
        last = now
        if step == 0:
            print("training", flush=True)
        time.sleep(step_s)
    final = client.pull()["w"]
    if servers is None:
        client.barrier()  # nobody says done (ending the job) before everyone has pulled
values, counts = np.unique(final, return_counts=True)
lost = {r: [int(s) for s in np.flatnonzero(final[r * steps:(r + 1) * steps] == 0)] for r in range(workers)}
print(json.dumps({"rank": rank, "counts": {str(float(v)): int(c) for v, c in zip(values, counts)},
                  "max_gap": max(gaps), "lost": lost}), flush=True)
