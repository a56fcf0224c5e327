"""Shared test helpers: polling, free ports, one in-process server, a manual clock, a reference
fake worker. Importable as ``support`` from every test folder (pyproject: ``pythonpath = tests``)."""
