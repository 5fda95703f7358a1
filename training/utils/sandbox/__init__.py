"""Agent processes in namespaces of their own, and the first process inside each sandbox."""
