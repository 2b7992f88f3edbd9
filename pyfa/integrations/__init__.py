"""pyfa inside other libraries' models: transformers (pyfa.integrations.transformers)."""
