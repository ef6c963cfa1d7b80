"""Process plumbing shared by the serving processes: background loops, the garbage
collector's settings, and transformers' progress bars kept off the serving console."""
