"""Parsers of the tools' text output (nvidia-smi, ...): pure functions, typed results, no Prefect.

Each module also exports the exact command lines the product runs, so product code and tests
share one definition of what is asked and what shape comes back.
"""
