"""Prefect tasks, one module per runbook step, built on vllm_redeploy's node access."""
