"""Building-block config groups; a package so they ship inside the wheel."""
