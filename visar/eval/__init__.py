"""Evaluation: the shapes-world detector, benchmarks, FID and GenEval harnesses."""
