"""Real servers for tests: OpenSSH and Docker engines on loopback, started and stopped by code."""
