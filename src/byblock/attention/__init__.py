"""Attention for long prompts: Stem sparse prefill (stem.py) and its transformers integration (hf_stem.py)."""
