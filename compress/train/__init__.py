"""Training: the shared loop, fine-tuning, distillation and metric logging."""
