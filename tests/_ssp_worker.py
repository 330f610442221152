"""A worker for the SSP tests: ``steps`` push_pulls of the gradient rank+1, sleeping ``step_s`` after each.

Prints JSON: per step the wall-clock time before the push was sent and after the push_pull returned.
"""

import json
import sys
import time

import numpy as np

import psrt

endpoint, rank, workers, steps, step_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \
    float(sys.argv[5])
rows = len(sys.argv) > 6 and sys.argv[6] == "rows"  # an embedding table instead of a dense tensor
ids = np.array([3, 7], np.int64)
before, after = [], []
with psrt.Client([endpoint], rank=rank, num_workers=workers) as client:
    if rows:
        client.init_embedding("t", dim=4, optimizer=psrt.SGD(lr=1.0), init="zeros")
    else:
        client.init({"w": np.zeros(8, np.float32)}, optimizer=psrt.SGD(lr=1.0))
    for _ in range(steps):
        before.append(time.time())
        if rows:
            client.push_rows("t", ids, np.full((2, 4), rank + 1, np.float32))
            client.pull_rows("t", ids)
        else:
            client.push_pull({"w": np.full(8, rank + 1, np.float32)})
        after.append(time.time())
        time.sleep(step_s)
    final = client.pull_rows("t", ids).reshape(-1)[:8] if rows else client.pull()["w"]
print(json.dumps({"rank": rank, "before": before, "after": after, "w": final.tolist()}), flush=True)
