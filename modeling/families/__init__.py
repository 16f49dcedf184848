"""Model families: one folder each (config with its Hugging Face key table, presets), listed by
``model_type`` in ``modeling.registry``."""
