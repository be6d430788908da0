"""vllm-redeploy: bring a multi-node vLLM server back by itself.

The Prefect-free plumbing lives in this package: settings (``config``), node access
(``nodes``) and parsers of tool output. ``tasks/``, ``flows/`` and ``deployments/`` build on it
(the command line is ``deployments/cli``); nothing here imports them or Prefect
(tests/test_architecture.py).
"""

PROJECT = "vllm-redeploy"
