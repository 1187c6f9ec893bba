"""Moved to tests/helpers/reference.py; this name stays for the modules that still import it from here."""

from tests.helpers.reference import random_prompts, transformers_greedy  # noqa: F401
