"""Helpers shared by tests in more than one folder, imported as ``tests.support.NAME``.

The repository root is on sys.path through pytest's ``pythonpath`` setting
(pyproject.toml), the one way tests reach these and the bench scripts.
"""
