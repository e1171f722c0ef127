"""One daemon per (device, backbone): loads the backbone once, exports it read-only, leases it to functions."""
