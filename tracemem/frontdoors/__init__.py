"""Front doors: a training job as its users write it, translated into a ``tracemem.job.Job``.

One module per source format, each with three tables (STYLE.md "Config"): the inputs it
honours, those that do not change memory, those it refuses by name with what is missing.

- ``tracemem.frontdoors.megatron``: Megatron-LM arguments (a ``pretrain_gpt.py`` command line,
  ``@file`` argument files, a functional test's ``model_config.yaml``) at NVIDIA/Megatron-LM
  d98e8a6; its tables are ``megatron_tables``, its argument set
  ``data/megatron_arguments_d98e8a6.json``.
"""

from tracemem.frontdoors.megatron import (following_changes, in_megatron_terms,
                                          megatron_approximations,
                                          megatron_flag_changes, megatron_job,
                                          megatron_job_kwargs, to_megatron_args)
from tracemem.frontdoors.megatron_args import (expand_megatron_args, megatron_args_from_yaml,
                                               parse_megatron_args)

__all__ = ["megatron_job_kwargs", "megatron_job", "megatron_approximations", "in_megatron_terms",
           "to_megatron_args", "megatron_flag_changes", "expand_megatron_args",
           "megatron_args_from_yaml", "parse_megatron_args", "following_changes"]
