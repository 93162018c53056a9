"""Public coding-agent runs replayed step by step through the routing policy in front of a caching fake pair."""
