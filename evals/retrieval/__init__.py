"""Retrieval's scoring measured on this repository's code (python -m evals.retrieval)."""
