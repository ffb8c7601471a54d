"""Training the target's own drafting modules: Medusa heads (medusa.py), the EAGLE layer
(eagle.py), and what they share (distill.py: the target's fingerprint and head, cached features,
the resumable loop). The drafters that run them live in drafters/medusa.py and drafters/eagle.py."""
