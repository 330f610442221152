"""A worker for cluster tests: finds everything through the scheduler (``psrt.Client()`` with no arguments).

Arguments: ``STEPS [EXIT_CODE]``. Prints one JSON line with its rank, W and final parameters.
"""

from __future__ import annotations

import json
import sys

import numpy as np

import psrt

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
exit_code = int(sys.argv[2]) if len(sys.argv) > 2 else 0

with psrt.Client() as client:
    if exit_code and client.rank == 1:
        sys.exit(exit_code)  # a worker that fails: the launcher must stop everything
    params = client.init({"w": np.zeros(100_000, np.float32), "b": np.zeros(3, np.float32)},
                         optimizer=psrt.SGD(lr=1.0))
    client.barrier()
    for _ in range(steps):
        grads = {"w": np.full(100_000, client.rank + 1, np.float32), "b": np.ones(3, np.float32)}
        params = client.push_pull(grads)
    client.barrier()
    print(json.dumps({"rank": client.rank, "num_workers": client.num_workers, "servers": client.servers,
                      "w0": float(params["w"][0]), "b0": float(params["b"][0])}), flush=True)
