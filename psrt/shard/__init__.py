"""The shard side: a server owning a part of the parameters (:mod:`.server`, its loop), the checks before a
request changes anything (:mod:`.admission`), the state and the round rules (:mod:`.store`), pulls that wait
(:mod:`.pulls`), replies (:mod:`.answers`), counters (:mod:`.counters`), embedding tables (:mod:`.tables` the
service, :mod:`.embedding` the row store) and checkpoints (:mod:`.checkpoint` the files, :mod:`.recovery` which
rank a shard is and what it restores).
"""
