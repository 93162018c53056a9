"""A conversation's context as the gateway manages it before a deployment reads it: token counts, the edits an
API asks for (clearing old tool results and thinking, compaction), what each edit took away (pure)."""
