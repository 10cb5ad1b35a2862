"""decodekit serve: an OpenAI-compatible server with continuous batching, and a load generator for any such server."""
