"""The OpenAI-compatible gateway in front of every model (cluster and local modes)."""
