"""Verifiable tasks with exact reward checks (the demo task lives here)."""
