"""The OpenAI Responses API's own features beyond the request path's adapter (pure)."""
