"""A session's context: summaries that stand in for a conversation's past, and the seal that carries them (pure)."""
