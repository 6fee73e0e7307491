"""Drafter training: `draftflow train dflash|mtp` against a frozen target (see docs in cli.py)."""
