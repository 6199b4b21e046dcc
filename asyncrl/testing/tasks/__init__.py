"""Verifiable tasks with exact reward checks: ``arithmetic``, the demo's addition task."""
