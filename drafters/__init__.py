"""Target wrapper, draft vocabulary, and the drafters (one file each, found through a registry)."""
