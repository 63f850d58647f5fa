"""Data preparation: read, deduplicate, filter, split, tokenize and pack dialogs."""
