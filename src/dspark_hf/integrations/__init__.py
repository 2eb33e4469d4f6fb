"""Where other code is met: transformers' generate() and Auto classes, the Hub, and the DeepSpec, speculators
and GGUF formats."""
