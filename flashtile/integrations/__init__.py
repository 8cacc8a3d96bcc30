"""Integrations of flashtile with other libraries (each imports its library lazily, when used)."""
