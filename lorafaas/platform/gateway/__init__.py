"""The HTTP edge: lorafaas' own API, the OpenAI-compatible API, health and Prometheus metrics (FastAPI)."""
