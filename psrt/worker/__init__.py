"""The worker side: the client a training loop embeds (:mod:`.client`), its calls in flight (:mod:`.calls`,
:mod:`.handles`), how a push becomes messages (:mod:`.pushes`), where pulled parameters land (:mod:`.buffers`),
embedding tables (:mod:`.embedding_client`) and the end of a worker's process (:mod:`.exits`). ``psrt.torch``
builds on it.
"""
