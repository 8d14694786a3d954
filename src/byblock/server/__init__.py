"""`byblock serve`: the OpenAI-compatible server (app, engine bridge, metrics, playground)."""
