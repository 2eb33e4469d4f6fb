"""Drafter configurations and models: pure `nn` code (DSpark, DFlash mode, Gemma-4 layers, EAGLE-3)."""
