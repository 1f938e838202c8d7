"""The diffusion app's OpenAI-compatible HTTP API: wire schema, routes and the FastAPI app."""
