"""vllm-redeploy: bring a multi-node vLLM server back by itself.

The Prefect-free plumbing lives in this package: settings (``config``), node access
(``nodes``) and parsers of tool output. ``flows/`` and ``tasks/`` build on it.
"""

PROJECT = "vllm-redeploy"
