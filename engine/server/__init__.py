"""OpenAI-compatible HTTP server for the engine (`kvpool serve`)."""
