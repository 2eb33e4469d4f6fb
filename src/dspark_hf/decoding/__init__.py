"""The speculative round: draft, choose lengths, verify, accept, commit (`core.py`), and its parts."""
