"""The checkpoint contract every stage reads and writes: resolve, load, manifest, guarded writes."""
