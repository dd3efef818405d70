"""Qwen3 / Qwen3-MoE in Megatron-core: config mapping, specs, model chunks, HF weight import/export."""
