"""Moving bytes between ranks: communicators over ``deepspeed.comm`` or mpi4py (:mod:`.communicators`), which
ranks share a node (:mod:`.topology`), and the check that every rank runs the same settings (:mod:`.agreement`)."""
