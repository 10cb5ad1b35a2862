"""decodekit serve: an OpenAI-compatible server with continuous batching, and a load generator for any such server."""

#: After a stream's first text, how long the server gathers what is decoded before writing it
#: (``decodekit serve --stream-interval-ms``; see ``reply.Outbox``).
STREAM_INTERVAL_S = 0.02
#: Requests decoded together, and requests waiting for a slot before the server answers 503
#: (``--max-batch``, ``--max-queue``).
MAX_BATCH = 8
MAX_QUEUE = 64
#: Seconds a client answered 503 is asked to wait (``Retry-After``).
RETRY_AFTER_S = 1
#: Host memory for the keys and values of prompts that left their slots (``--prompt-cache-mib``;
#: see ``prompt_cache``). llama.cpp's server keeps up to 8 GiB by default.
PROMPT_CACHE_MIB = 1024
