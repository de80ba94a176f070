"""The drafters (one file each, found through a registry) and the blocks they share; below them,
the target they serve (`target/`), how they are stored (`storage/`) and what users configure (`config/`)."""
