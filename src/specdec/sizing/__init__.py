"""How much to draft: draft-length schedules, measured pass costs, the theory behind them,
and the batch policy of the engine.
"""
