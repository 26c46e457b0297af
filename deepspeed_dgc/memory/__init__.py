"""What each rank keeps between steps: error-feedback residuals (:mod:`.error_feedback`) and local momentum
states (:mod:`.momentum`, behind :class:`~deepspeed_dgc.memory.momentum.MomentumState`)."""
