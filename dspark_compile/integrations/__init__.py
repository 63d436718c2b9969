"""Integrations with code someone else wrote: Hugging Face ``generate`` (``transformers``) and
the real weights the demo and tests use (``smollm2``). The top layer: it may import every
other part of the package, and nothing in the package imports it."""
