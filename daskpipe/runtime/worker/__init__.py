"""Stage worker processes: one per GPU x MPS slice, holding model stages and fetching inputs."""
