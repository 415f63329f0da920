"""Backends turn tokenized samples into hidden states (hf: in-process; sglang: patched server)."""
