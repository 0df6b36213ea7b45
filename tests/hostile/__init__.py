"""Hostile inputs: damaged and crafted files, folders and state dicts; every refusal one line."""
