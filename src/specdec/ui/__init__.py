"""What a person sees: the interactive chat session and the coloured step display.
"""
