"""flare's HTTP face: OpenAI-compatible routes on quart-trio, metrics, error mapping."""
