"""Loading models (a catalogue name, a Hugging Face folder or a .gguf file), the model
catalogue, vocabularies, and which model of a pair is the target.
"""
