"""Coordinator: the asyncio server that owns the run (see DESIGN.md §1)."""
