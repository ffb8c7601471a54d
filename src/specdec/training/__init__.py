"""The fit loops of the trained drafting modules: Medusa heads (fit_medusa.py), the EAGLE layer
(fit_eagle.py), a parallel drafter (fit_parallel.py), a distilled drafter (fit_distilled.py), and
what they share (distill.py: cached features, the resumable loop). Only the CLI imports them; the
modules themselves, their checkpoints and what runs them live in adapters/ and drafters/."""
