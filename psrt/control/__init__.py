"""The control plane, below both sides: the scheduler that forms a job and watches it (:mod:`.scheduler`, with
:mod:`.formation`, :mod:`.barriers` and :mod:`.restarts`), a server's or worker's link to it (:mod:`.link`:
registration, barriers, heartbeats), the job's keys (:mod:`.security`), child processes (:mod:`.process`) and
Prometheus metrics (:mod:`.metrics`). No tensor bytes pass through here.
"""
