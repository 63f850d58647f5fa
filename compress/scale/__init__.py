"""Training at scale: memory and communication model, parallelism planner, run diagnosis."""
