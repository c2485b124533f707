"""Bridges to other frameworks. Each module imports its framework lazily, on first use, so that
``import s2attn`` never needs them: ``s2attn.integrations.transformers`` for HuggingFace,
``s2attn.integrations.megatron`` for Megatron-core."""
