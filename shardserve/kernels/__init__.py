"""Small native kernels compiled on first use, for hardware torch's own kernels serve poorly."""
