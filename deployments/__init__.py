"""How runs are started: schedules, the reboot webhook and the node notifier."""
