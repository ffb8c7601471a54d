"""The pure rules: samplers, token trees, verification (every acceptance rule), logit
penalties, logprobs and grammar masks. Tensors in, tensors out; no models, no state.
"""
