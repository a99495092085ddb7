"""Bundled device and cluster profiles (YAML data files, each figure with its source).
Load them with `autopar.ClusterSpec.load(NAME)`."""
