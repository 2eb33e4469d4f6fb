"""Shared helpers: files, prompt records, checkpoint checks and the table of transformers' private API."""
