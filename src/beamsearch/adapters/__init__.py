"""Model adapters: hf.py (Hugging Face transformers, imported lazily)."""
