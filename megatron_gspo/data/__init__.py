"""Prompt data and tokenizers."""
