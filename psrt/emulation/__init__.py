"""Emulation: hosts in network namespaces (:mod:`.netns`), the load generator ``psrt worker`` (:mod:`.loadgen`),
the performance model (:mod:`.perfmodel`) and the shape lists of real models (:mod:`.models`).
"""
