"""Process plumbing shared by the serving processes: background loops and the garbage
collector's settings."""
