"""Adapters at the edge: JSONL files for the embedded mode, Kafka for streaming."""
