"""A worker for the tests of how a job ends: trains with push_pull, and one rank misbehaves as told.

``python _crash_worker.py STEPS`` under a scheduler (``psrt.Client()`` from the environment). ``HOW=RANK:STEP:WHAT``
makes worker RANK, after STEP steps, do WHAT: ``raise`` (an uncaught RuntimeError, client left open), ``raise-with``
(the same inside ``with psrt.Client()``), ``exit-N`` (``sys.exit(N)``, client left open), ``return`` (the script
simply ends, client left open), ``finish`` (close the client and end, as a worker with fewer steps would).
``MODE_TENSORS=rows`` adds an embedding table to every step. Prints ``training`` after the first step, and
``done STEPS`` at a normal end.
"""

import contextlib
import os
import sys

import numpy as np

import psrt

steps = int(sys.argv[1])
rank_s, step_s, what = (os.environ.get("HOW", "-1:0:none").split(":") + [""])[:3]
bad_rank, bad_step = int(rank_s), int(step_s)
rows = os.environ.get("MODE_TENSORS") == "rows"

client = psrt.Client()
scope = client if what == "raise-with" or client.rank != bad_rank else contextlib.nullcontext()
with scope:
    client.init({"w": np.zeros(1000, np.float32)}, optimizer=psrt.SGD(lr=0.1))
    if rows:
        client.init_embedding("t", dim=4, optimizer=psrt.SGD(lr=0.1), init="zeros")
    for step in range(steps):
        if client.rank == bad_rank and step == bad_step:
            if what.startswith("raise"):
                raise RuntimeError("user bug in the training script")
            if what.startswith("exit-"):
                sys.exit(int(what.split("-")[1]))
            if what == "finish":
                client.close()
            break
        client.push_pull({"w": np.ones(1000, np.float32)})
        if rows:
            client.push_rows("t", np.array([1, 2]), np.ones((2, 4), np.float32))
            client.pull_rows("t", np.array([1, 2]))
        if step == 0:
            print("training", flush=True)
    else:
        print(f"done {steps}", flush=True)
