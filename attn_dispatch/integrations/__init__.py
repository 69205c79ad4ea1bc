"""Adapters for the clients users already run; each translates arguments and calls the same selection."""
