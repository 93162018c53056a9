"""The agents' own APIs on the wire (OpenAI Responses, Anthropic Messages): what the gateway reads and writes."""
