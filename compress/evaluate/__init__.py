"""Quality of a compressed checkpoint against its parent: perplexity, KL, same top-1, size, speed."""
