"""Launch scripts (demo, benchmarks) and their offline data loaders."""
