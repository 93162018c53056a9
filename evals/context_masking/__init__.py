"""Public coding-agent runs replayed through a policy's masking of old tool outputs (`python -m evals.context_masking`).
"""
