"""Actions: what the watchdog does about a decision (flush the cache, restart the pod)."""
