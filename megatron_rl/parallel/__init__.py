"""Process groups, device selection, the CPU compatibility layer and vocab-parallel math."""
