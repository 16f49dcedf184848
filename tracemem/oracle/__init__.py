"""Megatron-Core itself as the oracle (``tracemem validate --against megatron-core``): its
model run on the meta device under a fake process group with tracemem's ``megatron-te``
kernels as leaves (``megatron_patches``, ``megatron_spec``), compared per layer (and for the
whole model) with tracemem's ``build_rank`` (``compare``), and its ``DistributedDataParallel``
and ``DistributedOptimizer`` compared per rank with ``tracemem.static`` (``static_oracle``).
Needs the ``megatron`` extra (megatron-core 0.16.1); ``docs/validation.md`` has the tables and
the residue, which is code: ``compare.RESIDUE``, ``static_oracle.STATIC_RESIDUE``."""
