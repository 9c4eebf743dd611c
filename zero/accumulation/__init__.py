"""Gradient accumulation schedules: the unit-major one (a step's micro-batches through each unit at once)."""
