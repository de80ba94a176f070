"""Hydra configuration (YAML only); a package so the YAML ships with the wheel."""
