"""Benchmarks behind ``deltacast bench``: one module per kind, shared JSON rows (``rows``)."""
