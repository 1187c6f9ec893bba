"""Formats the ranks speak to each other, below both sides: the step plan rank 0 decides and the other ranks
replay (step_plan.py), used by the engine that writes it and the control plane that carries it."""
