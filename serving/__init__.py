"""Bundled speculative-decoding serving loop (engine, benchmark)."""
