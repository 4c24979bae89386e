"""The REST API: OpenAI's Files and Batches API plus our extensions. Never imports torch."""
