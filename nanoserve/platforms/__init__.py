"""Fast paths for each kind of device, each entering the core through one of its plug points."""
