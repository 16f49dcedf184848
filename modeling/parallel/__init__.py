"""Sharding of the model over a parallel layout: plans (which module is split how) and
``build_rank`` (the modules one rank holds, with local shapes)."""
