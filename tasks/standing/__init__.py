"""A cluster's standing, kept in Prefect so that it outlives every process: the lock that lets
one run at a time touch it (``lock``), the marks people and recoveries leave on it (``marks``:
paused, crash-looping) and its recent recoveries (``recoveries``: count, pacing, under way).

This floor lies below the steps (tasks/), the flow and the deployments, which all read it; it
imports none of them (tests/test_architecture.py).
"""
