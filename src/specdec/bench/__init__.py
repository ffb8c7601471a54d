"""The benchmark harness: datasets, methods, and one-run reports."""
