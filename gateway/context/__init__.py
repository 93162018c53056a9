"""A conversation's context as the gateway manages it before a deployment reads it: token counts, the edits an
API asks for (clearing old tool results and thinking), summaries that stand in for a conversation's past (one
anchored summarizer for every API's compaction), the seal that carries them, what each edit took away (pure)."""
