"""The Kubernetes API: the client the sidecar carries (its memory budget) and what it reads and writes."""
