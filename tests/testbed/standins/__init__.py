"""Stand-ins for what needs a GPU (nvidia-smi, vLLM) and for systemctl, in real formats."""
