"""An agent's session as the gateway sees it: its steps, the outcomes of its tools (pure half first)."""
