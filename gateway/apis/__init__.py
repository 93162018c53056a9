"""Each API the gateway serves as an adapter at the two ends of the one request pipeline (pure)."""
