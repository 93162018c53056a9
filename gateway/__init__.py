"""agent-gateway: an OpenAI-compatible routing proxy in front of a high-quality and a fast deployment."""

__version__ = "0.1.0"
