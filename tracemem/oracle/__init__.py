"""Megatron-Core itself as the oracle (``tracemem validate --against megatron-core``): its
model run on the meta device under a fake process group with tracemem's ``megatron-te``
kernels as leaves (``megatron_patches``, ``megatron_spec``), compared per layer with
tracemem's ``build_rank`` (``compare``). Needs the ``megatron`` extra (megatron-core 0.16.1);
``docs/validation.md`` has the table and the residue."""
