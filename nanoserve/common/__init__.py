"""Torch-free contracts both processes import: the wire, configs, sampling parameters,
checkpoint resolution, prefix hashes and facts about this machine."""
