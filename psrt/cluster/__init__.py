"""Cluster tools: ``psrt launch`` and ``psrt run`` (:mod:`.launch`), the bodies of the daemon processes
(:mod:`.daemon`), local shards for tests and benchmarks (:mod:`.local`), and ``psrt stats`` / ``psrt checkpoint``
(:mod:`.stats`).
"""
