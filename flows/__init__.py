"""Prefect flows: the operator's runbook, one task call per step (see tasks/)."""
