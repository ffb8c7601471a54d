"""The run-time halves of trained drafting modules (LoRA distillation, PARD, Medusa, EAGLE),
and their export into vLLM's layouts. training/ fits them.
"""
