"""modeling: the DeepSeek-V3 / V2 module graph on the meta device, with Megatron-style sharding.

Filled by later work (see the issues); the package exists so that the layout is stable.
"""
