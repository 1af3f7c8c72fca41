"""Workloads: loaders for real traces and agent sessions."""
