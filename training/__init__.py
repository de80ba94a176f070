"""Training entry point (`python -m training.run`) and loop."""
