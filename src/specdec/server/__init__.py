"""`specdec serve`: the OpenAI API over the batched engine (app.py), its request checks
(schema.py), what a request may ask of the loaded models (service.py), the engine's thread
(worker.py) and the Prometheus metrics (metrics.py)."""
