"""The batched Engine, its requests, the OpenAI-compatible protocol and HTTP server, the load benchmark."""
