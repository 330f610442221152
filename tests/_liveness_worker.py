"""A worker for the liveness tests: trains until told otherwise, then reports how its job ended, as JSON.

Prints ``training`` once its first step is done, then pushes and pulls every ``step_s`` seconds until
``steps`` steps are done or psrt raises. The last line is ``{"error": type, "message": ..., "at": time.time()}``.
"""

import json
import os
import signal
import sys
import time

import numpy as np

import psrt

steps, step_s = int(sys.argv[1]), float(sys.argv[2])
result = {"error": None, "message": "", "at": 0.0, "steps": 0, "max_gap": 0.0, "rank": -1}
try:
    with psrt.Client() as client:
        result["rank"] = client.rank
        start = client.init({"w": np.zeros(1000, np.float32)}, optimizer=psrt.SGD(lr=0.1))
        result["init_w0"] = float(start["w"][0])
        last = None
        for step in range(steps):
            params = client.push_pull({"w": np.ones(1000, np.float32)})
            now = time.monotonic()
            if last is not None:  # the longest wait for one step: a stall shows here
                result["max_gap"] = max(result["max_gap"], now - last)
            last = now
            result["steps"] = step + 1
            result["w0"] = float(params["w"][0])
            if step == 0:
                print("training", flush=True)
            # DIE_AT=RANK:STEP: that worker kills itself (SIGKILL) after that step, as a crash would.
            die = os.environ.get("DIE_AT", "").split(":")
            if len(die) == 2 and int(die[0]) == client.rank and int(die[1]) == step:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(step_s)
except psrt.PsrtError as exc:
    result.update(error=type(exc).__name__, message=str(exc), at=time.time())
print(json.dumps(result), flush=True)
sys.exit(1 if result["error"] else 0)
