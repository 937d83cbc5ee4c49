"""Adapters that plug cubeattn into other libraries; each module imports its library on import
(`cubeattn.integrations.transformers` needs transformers)."""
