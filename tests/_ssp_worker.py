"""A worker for the SSP tests: ``steps`` steps, each pushing the gradient rank+1 and pulling, sleeping ``step_s``
after each, in one of several push patterns.

Patterns: ``dense`` (one push_pull of tensor "a"), ``rows`` (push_rows then pull_rows of a table), and, over two
tensors "a" and "b": ``apart`` (push a, push b, then pull both), ``backward`` (push b, then a, as a framework's
backward does, then pull), ``subset`` (push a every step, b every other step, then pull both), ``async``
(non-blocking pushes of a and b overlapped, then a non-blocking pull). Prints JSON: per step the wall-clock time
before the step's first push was sent and after its pull returned, and the final values.
"""

import json
import sys
import time

import numpy as np

import psrt

endpoint, rank, workers, steps, step_s = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \
    float(sys.argv[5])
pattern = sys.argv[6] if len(sys.argv) > 6 else "dense"
ids = np.array([3, 7], np.int64)
before, after = [], []


def g() -> np.ndarray:
    return np.full(8, rank + 1, np.float32)


with psrt.Client([endpoint], rank=rank, num_workers=workers) as client:
    if pattern == "rows":
        client.init_embedding("t", dim=4, optimizer=psrt.SGD(lr=1.0), init="zeros")
    else:
        client.init({"a": np.zeros(8, np.float32), "b": np.zeros(8, np.float32)}, optimizer=psrt.SGD(lr=1.0))
    for step in range(steps):
        before.append(time.time())
        if pattern == "rows":
            client.push_rows("t", ids, np.full((2, 4), rank + 1, np.float32))
            client.pull_rows("t", ids)
        elif pattern == "dense":
            client.push_pull({"a": g()})
        elif pattern in ("apart", "backward"):
            for name in ("a", "b") if pattern == "apart" else ("b", "a"):
                client.push({name: g()})
            client.pull(["a", "b"])
        elif pattern == "subset":
            client.push({"a": g()})
            if step % 2 == 0:
                client.push({"b": g()})
            client.pull(["a", "b"])
        else:  # async
            handles = [client.push_async({"a": g()}), client.push_async({"b": g()})]
            for h in handles:
                h.wait()
            client.pull_async(["a", "b"]).wait()
        after.append(time.time())
        time.sleep(step_s)
    if pattern == "rows":
        final = {"a": client.pull_rows("t", ids).reshape(-1)[:8].tolist()}
    else:
        final = {k: v.tolist() for k, v in client.pull().items()}
print(json.dumps({"rank": rank, "before": before, "after": after, "w": final}), flush=True)
