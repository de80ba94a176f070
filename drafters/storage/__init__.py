"""Drafters on disk: training checkpoints and native artifacts, and the atomic writes every
command makes."""
