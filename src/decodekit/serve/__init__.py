"""decodekit serve: an OpenAI-compatible server with continuous batching, and a load generator for any such server."""

#: After a stream's first text, how long the server gathers what is decoded before writing it
#: (``decodekit serve --stream-interval-ms``; see ``app.Outbox``).
STREAM_INTERVAL_S = 0.02
