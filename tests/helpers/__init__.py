"""Helpers shared by several test modules: import them from here, never from another test_*.py file."""
