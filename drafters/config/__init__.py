"""What users pass: typed settings with their ranges, and the one-line errors every command gives."""
